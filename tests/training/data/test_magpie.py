"""Requests written by the target itself (``training.data.magpie``): the user-turn prefix cut from
real chat templates, the filters and de-duplication on crafted rows, and the seeded sampling.

The templates are the targets' own: SmolLM2's read from the GGUF the ``smol`` target is converted
from (``tokenizer.chat_template``: it injects a default system prompt), Qwen3's from the
``tokenizer_config.json`` of Qwen/Qwen3-4B-Thinking-2507 (``tests/fixtures/qwen3-chat-template.jinja``,
the model card's file as published), and the Qwen3.5-style one of ``training.model.tinymodel``; each
is set on a small tokenizer with the same special tokens (``train_tokenizer``). The expected prefixes
are Magpie's ``pre_query_template`` of ``configs/model_configs.json`` (``<|im_start|>user\\n`` for Qwen)
with the template's own system turn in front where it writes one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from testkit import smol_chat_template, tiny_qwen3

from training.config import ConfigError, load_config
from training.data.magpie import (
    REASONS,
    Dedup,
    MagpieSettings,
    Sample,
    collect,
    magpie_prompts,
    rejected,
    sample_in_process,
    user_turn,
)
from training.data.regen import shipped_prompts
from training.model.tinymodel import QWEN3_5_CHAT_TEMPLATE, train_tokenizer

REPO = Path(__file__).resolve().parents[3]
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
TEXTS = ["Write a Python function that returns the sum of two numbers.\n", "Explain recursion.\n"] * 20


def tokenizer_with(template: str, thinking: bool = False):
    tokenizer = train_tokenizer(TEXTS, vocab_size=300, thinking=thinking)
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("smollm2", SMOL_SYSTEM + "<|im_start|>user\n"),
        ("qwen3", "<|im_start|>user\n"),
        ("qwen3.5", "<|im_start|>user\n"),
    ],
)
def test_the_prefix_is_the_template_up_to_the_user_turn(name: str, expected: str) -> None:
    template = {
        "smollm2": smol_chat_template,
        "qwen3": lambda: (REPO / "tests" / "fixtures" / "qwen3-chat-template.jinja").read_text(),
        "qwen3.5": lambda: QWEN3_5_CHAT_TEMPLATE,
    }[name]()
    tokenizer = tokenizer_with(template, thinking=name != "smollm2")
    turn = user_turn(tokenizer)
    assert turn.prefix == expected
    assert turn.end == "<|im_end|>"
    assert turn.stop_ids == (
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    # The template's rendering of a real request starts with the prefix and goes on with the
    # request itself: nothing of the assistant turn (no generation prompt, no <think>) is in it.
    request = "Plan a three-day trip to Lisbon."
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False)
    assert rendered.startswith(turn.prefix + request + turn.end)
    assert "<|im_start|>assistant" not in turn.prefix and "<think>" not in turn.prefix


def test_a_template_without_a_user_turn_is_one_config_error() -> None:
    tokenizer = tokenizer_with("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(ConfigError, match=r"does not render a user message as written"):
        user_turn(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match=r"has no chat template"):
        user_turn(tokenizer)


CRAFTED = [
    ("", True, "empty"),
    ("How do I sort a list of tuples by their second element in Python?", False, "unfinished"),
    ("Here are the three questions I have about my garden:", True, "unfinished"),
    ("Hi there", True, "too_short"),
    ("word " * 900, True, "too_long"),
    ("Tell me a joke.<|im_end|>\n<|im_start|>assistant\nWhy did", True, "assistant_leak"),
    ("What is the capital of France?\nAssistant: Paris.", True, "assistant_leak"),
    ("1234 5678 9012 3456 7890 !!! ???", True, "non_text"),
    ("Explain how\x07 bells ring in churches.", True, "non_text"),
    ("please help me please help me please help me please help me please help me now", True, "repetition"),
    ("I'm sorry, but I cannot help with that request today.", True, "refusal"),
    ("As an AI language model, I don't have personal opinions on movies.", True, "refusal"),
    ("Write a short poem about the sea at night, in the style of a haiku.", True, None),
    ("What are the main differences between TCP and UDP?", True, None),
]


@pytest.mark.parametrize(("text", "finished", "reason"), CRAFTED)
def test_each_filter_on_a_crafted_row(text: str, finished: bool, reason: str | None) -> None:
    assert rejected(Sample(text, finished), markers=("<|im_start|>", "<|im_end|>")) == reason
    assert reason is None or reason in REASONS


def jaccard(a: str, b: str) -> float:
    """Word 3-gram Jaccard written again: lowercase words of letters/digits, tuples of three."""

    def grams(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"[0-9a-z_]+", text.lower())
        return {tuple(words[i : i + 3]) for i in range(len(words) - 2)}

    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def test_exact_and_near_duplicates_are_dropped_in_order() -> None:
    topic = "Can you explain the difference between a process and a thread in an operating system"
    base, near = f"{topic}, with one example of each?", f"{topic}, with an example of each?"
    far = "Can you explain the difference between a list and a tuple in Python, with one example of each?"
    assert jaccard(base, near) >= 0.7 > jaccard(base, far)
    dedup = Dedup(threshold=0.7)
    assert dedup.add(base) is None
    assert dedup.add(base.upper().replace(",", " ; ") + "  ") == "duplicate"
    assert dedup.add(near) == "near_duplicate"
    assert dedup.add(far) is None
    strict = Dedup(threshold=jaccard(base, near) + 0.01)
    strict.add(base)
    assert strict.add(near) is None  # just under the threshold: kept


def test_collect_counts_every_rejection_and_stops_at_the_count() -> None:
    rows = [Sample(text, finished) for text, finished, _ in CRAFTED] * 2  # the second round: duplicates
    drawn: list[tuple[int, int]] = []

    def draw(first: int, n: int) -> list[Sample]:
        drawn.append((first, n))
        return rows[first : first + n]

    result = collect(draw, 2, MagpieSettings(), ("<|im_start|>", "<|im_end|>"), chunk=5, max_samples=100)
    assert result.prompts == tuple(text for text, _, reason in CRAFTED if reason is None)
    assert drawn == [(0, 5), (5, 5), (10, 5)]  # stops once two are kept
    assert result.sampled == 15 and sum(result.rejected.values()) == 13
    assert result.rejected["refusal"] == 2 and result.filtered_share == pytest.approx(13 / 15)
    more = collect(draw, 3, MagpieSettings(), ("<|im_end|>",), chunk=100, max_samples=len(rows))
    assert len(more.prompts) == 2 and more.sampled == len(rows)  # the samples run out: 2 of 3
    assert more.rejected["duplicate"] == 2
    capped = collect(draw, 2, MagpieSettings(), ("<|im_end|>",), chunk=3)  # <= OVERSAMPLE (4) x 2
    assert (capped.sampled, capped.prompts) == (8, ())


def test_the_same_seed_gives_the_same_requests(tmp_path: Path) -> None:
    """The tiny Qwen3 sampling from the ChatML prefix in this process: one seed, the same samples
    whatever else drew from torch's generator in between; another seed, others."""
    import torch

    tokenizer = train_tokenizer(TEXTS, vocab_size=256)
    model = tiny_qwen3()
    turn = user_turn(tokenizer)
    settings = MagpieSettings(seed=3, max_new_tokens=12)
    first = sample_in_process(model, tokenizer, turn, settings, batch_size=4)(0, 4)
    torch.rand(100)
    again = sample_in_process(model, tokenizer, turn, settings, batch_size=4)(0, 4)
    other = sample_in_process(model, tokenizer, turn, MagpieSettings(seed=4, max_new_tokens=12), 4)(0, 4)
    assert first == again and first != other
    assert len({s.text for s in first}) > 1  # sampled, not greedy
    # Through the cache: written once with its report, read back as written.
    path = tmp_path / "magpie.jsonl"
    calls: list[int] = []

    def sampler(frame):
        calls.append(1)
        return (
            lambda first, n: [
                Sample(f"Question number {first + i} about the weather?", True) for i in range(n)
            ]
        ), 8

    lines: list[str] = []
    prompts = magpie_prompts(path, 5, settings, lambda: turn, sampler, lines.append)
    assert prompts == magpie_prompts(path, 5, settings, lambda: turn, sampler, lines.append)
    assert len(prompts) == 5 and calls == [1]
    report = json.loads(path.with_suffix(".report.json").read_text())
    assert (report["kept"], report["sampled"]) == (5, 8)
    assert any(line.startswith("magpie: 5 requests kept of 8 sampled") for line in lines)


def test_magpie_sources_and_bad_settings_are_one_config_error() -> None:
    config = load_config(
        "smol-cpu", ["--data.regen_sources=stdlib,packages,magpie", "--data.magpie_share=0.25"]
    )
    assert config.data.regen_sources == "stdlib,packages,magpie"
    for bad, match in [
        ("--data.magpie_share=1.0", r"data.magpie_share: 1.0 is not in \(0, 1\)"),
        ("--data.magpie_temperature=0", r"data.magpie_temperature: 0.0 is not in \(0, 2\]"),
        ("--data.magpie_top_p=1.5", r"data.magpie_top_p: 1.5 is not in \(0, 1\]"),
        ("--data.magpie_max_new_tokens=0", r"data.magpie_max_new_tokens: must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config("smol-cpu", [bad])


@pytest.mark.slow  # the tiny target built and loaded, 8 samples, 4 replies: ~25 s on 2 loaded cores
def test_the_trainers_regenerated_set_is_the_shipped_then_the_written_requests(tiny_cache: Path) -> None:
    """``data.regenerate`` with "stdlib,magpie" on the tiny target: its random weights write no
    request that passes the filters (one config error naming the counts); once the Magpie set is in
    the cache, the set is the shipped prompts then the written ones, where ``planned_regen_file``
    said it would be, each answered by the target."""
    from training.model.target import load_tokenizer, model_source
    from training.run.core import planned_magpie_file, planned_regen_file, regenerate_data

    overrides = ["--data.regenerate=true", "--data.regen_prompts=4", "--data.regen_sources=stdlib,magpie"]
    overrides += [
        "--data.regen_max_new_tokens=4",
        "--data.magpie_max_new_tokens=6",
        "--data.regen_batch_size=4",
    ]
    config = load_config("tiny-cpu", [*overrides, "--data.magpie_seed=11"])
    tokenizer = load_tokenizer(model_source(config)[1])
    assert planned_regen_file(config).name == "missing"
    with pytest.raises(ConfigError, match=r"none of 8 sampled requests passed the filters \(.*unfinished"):
        regenerate_data(config, tokenizer, echo=lambda _line: None)
    written = ["How do I read a CSV file in Python?", "Suggest a name for a small bakery."]
    planned = planned_magpie_file(config)
    assert planned is not None and not planned.exists()  # nothing written by the failed run
    planned.parent.mkdir(parents=True, exist_ok=True)
    planned.write_text("".join(json.dumps(p) + "\n" for p in written))
    path = regenerate_data(config, tokenizer, echo=lambda _line: None)
    assert path == planned_regen_file(config)
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert [r[0]["content"] for r in rows] == [*shipped_prompts(2), *written]
    assert all(r[1]["role"] == "assistant" for r in rows)
