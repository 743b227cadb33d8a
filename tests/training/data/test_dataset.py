"""Data: loss only on completion / assistant tokens; local JSONL + Parquet through `datasets`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import ConfigError, DataSection
from training.data.buckets import Position
from training.data.corpus import build_default_corpus, chunk_file
from training.data.dataset import (
    GENERAL_PROMPTS,
    TrainData,
    load_prompt_set,
    load_tokenized,
    prompt_ids,
    tokenize_all,
    tokenize_chat,
    tokenize_completion,
    tokenize_record,
)
from training.data.formats import record_format, template_marks
from training.model.tinymodel import train_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The user asks a question and the assistant answers it.\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


def masked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_completion_mask_covers_exactly_the_completion_and_eos(tokenizer) -> None:
    ids, mask = tokenize_completion(tokenizer, "def add(a, b):\n", "    return a + b\n")
    assert len(ids) == len(mask)
    first = mask.index(1)
    assert all(m == 0 for m in mask[:first]) and all(m == 1 for m in mask[first:])
    assert tokenizer.decode(ids[:first]) == "def add(a, b):\n"
    assert ids[-1] == tokenizer.eos_token_id
    assert masked_text(tokenizer, ids, mask) == "    return a + b\n<|endoftext|>"


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "add two numbers"},
    {"role": "assistant", "content": "def add(a, b):"},
    {"role": "user", "content": "and print"},
    {"role": "assistant", "content": "print(i)"},
]


def test_chat_mask_covers_only_assistant_turns(tokenizer) -> None:
    ids, mask = tokenize_chat(tokenizer, CHAT)
    assert len(ids) == len(mask)
    labelled = masked_text(tokenizer, ids, mask)
    assert labelled == "def add(a, b):<|im_end|>\nprint(i)<|im_end|>\n"
    unlabelled = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "add two numbers" in unlabelled and "assistant\n" in unlabelled and "Be brief." in unlabelled


def test_chat_without_template_labels_assistant_lines(tokenizer) -> None:
    plain = train_tokenizer(TEXTS, vocab_size=300)
    plain.chat_template = None
    ids, mask = tokenize_chat(
        plain, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    assert masked_text(plain, ids, mask) == "assistant: yo\n<|endoftext|>"


def test_record_is_truncated_and_rejects_unknown_shapes(tokenizer) -> None:
    row = tokenize_record(
        {"prompt": "def add(a, b):\n", "completion": "    return a + b\n" * 20}, tokenizer, 16
    )
    assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"]) == 16
    odd = tokenize_record({"question": "x"}, tokenizer, 16)
    assert odd["format"] == "" and odd["length"] == 0


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_load_jsonl_and_parquet_then_batches(tokenizer, tmp_path: Path) -> None:
    records = [
        {"prompt": f"def f{i}(x):\n", "completion": "    return x + 1\n" * (1 + i % 5)} for i in range(40)
    ]
    _write_jsonl(tmp_path / "train.jsonl", records)
    data = DataSection(path=str(tmp_path / "train.jsonl"), max_length=64, token_budget=256, eval_prompts=4)
    tokenized = load_tokenized(data, tokenizer, tmp_path / "cache", tmp_path / "data-cache")
    assert len(tokenized) == 40
    assert any((tmp_path / "data-cache").iterdir())  # datasets' cache lives in the run's data cache
    train = TrainData(tokenized, data)
    assert train.num_sequences == 36 and len(train.eval_prompts(8, 10)) == 4
    batch, after = train.batch(Position(), tokenizer.pad_token_id, pad_to_bucket=False)
    assert batch.input_ids.shape == batch.loss_mask.shape
    assert batch.input_ids.shape[0] * batch.input_ids.shape[1] <= 256
    assert after == Position(0, 1)
    for row, length in enumerate(batch.lengths.tolist()):
        assert not batch.loss_mask[row, length:].any()

    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "train.parquet"))
    parquet = DataSection(path=str(tmp_path / "train.parquet"), max_length=64, token_budget=256)
    assert len(load_tokenized(parquet, tokenizer, tmp_path / "cache", tmp_path / "data-cache-2")) == 40


def test_eval_path_and_the_train_split(tokenizer, tmp_path: Path) -> None:
    """data.eval_path: every record of data.path trains and the eval prompts are the other file's;
    eval.split = "train": prompts of the training rows, spread over them (the memorisation check)."""
    train_records = [{"prompt": f"def f{i}(x):\n", "completion": "    return x + 1\n"} for i in range(12)]
    held_records = [{"prompt": f"def g{i}(y):\n", "completion": "    return y * 2\n"} for i in range(3)]
    _write_jsonl(tmp_path / "train.jsonl", train_records)
    _write_jsonl(tmp_path / "held.jsonl", held_records)
    data = DataSection(path=str(tmp_path / "train.jsonl"), max_length=64, token_budget=256, eval_prompts=4)
    caches = tmp_path / "cache", tmp_path / "data-cache"
    tokenized = load_tokenized(data, tokenizer, *caches)
    held = load_tokenized(DataSection(path=str(tmp_path / "held.jsonl"), max_length=64), tokenizer, *caches)
    train = TrainData(tokenized, data, held)
    assert train.num_sequences == 12 and len(train.eval_rows) == 3
    decode = tokenizer.decode
    assert [decode(p) for p in train.eval_prompts(64, 10)] == [r["prompt"] for r in held_records]
    from_training = [decode(p) for p in train.eval_prompts(64, 4, split="train")]
    assert from_training == [train_records[i]["prompt"] for i in (0, 3, 6, 9)]
    split = TrainData(tokenized, data)  # no eval_path: held out of the data itself, as before
    assert split.num_sequences == 8 and len(split.eval_rows) == 4


def test_bad_data_paths_are_config_errors(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenized(DataSection(path=str(tmp_path / "nope.jsonl")), tokenizer, tmp_path, tmp_path / "dc")
    _write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "a", "completion": "b"}, {"question": "hello"}])
    unknown = r"odd.jsonl line 2: a record of no known format \(keys found: question\)"
    with pytest.raises(ConfigError, match=unknown):
        load_tokenized(DataSection(path=str(tmp_path / "odd.jsonl")), tokenizer, tmp_path, tmp_path / "dc2")


def test_default_corpus_is_stdlib_completions(tmp_path: Path) -> None:
    path = build_default_corpus(tmp_path, max_files=5, chunk_lines=10, prompt_lines=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(r["prompt"].count("\n") == 3 for r in records)
    assert build_default_corpus(tmp_path, max_files=5, chunk_lines=10, prompt_lines=3) == path  # cached
    chunks = chunk_file("a\nb\nc\nd\ne\n", chunk_lines=3, prompt_lines=1)
    assert chunks == [{"prompt": "a\n", "completion": "b\nc\n"}, {"prompt": "d\n", "completion": "e\n"}]


CATEGORIES = ("chat", "explanation", "advice", "writing", "math", "reasoning", "code")


def test_the_general_set_is_shipped_balanced_and_read_by_the_loader(tokenizer, tmp_path: Path) -> None:
    """training/assets/general-prompts.jsonl: >= 96 distinct prompts, >= 10 of each category,
    round-robin (any first N is spread); the real loader reads it as messages records (with no
    reply to train on), and its eval prompts are the user turn with the generation prompt."""
    records = [json.loads(line) for line in GENERAL_PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 96
    counts = {c: sum(r["category"] == c for r in records) for c in CATEGORIES}
    assert set(r["category"] for r in records) == set(CATEGORIES) and min(counts.values()) >= 10, counts
    assert [r["category"] for r in records[:7]] == list(CATEGORIES)
    texts = [" ".join(r["messages"][0]["content"].lower().split()) for r in records]
    assert len(set(texts)) == len(texts) and len({r["id"] for r in records}) == len(records)
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in records)

    tokenized, fmt = tokenize_all(
        DataSection(path=str(GENERAL_PROMPTS)), tokenizer, tmp_path, tmp_path / "dc"
    )
    assert fmt == "messages" and len(tokenized) == len(records)
    assert set(tokenized["dropped"]) == {"no assistant reply"}  # an eval set, nothing to train on
    prompts = load_prompt_set("general", tokenizer, "keep", tmp_path / "dc")
    assert len(prompts) == len(records)
    first = tokenizer.decode(prompts[0])
    assert first.endswith("<|im_start|>assistant\n") and records[0]["messages"][0]["content"] in first
    _write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"x{i} = ", "completion": f"{i}\n"} for i in range(6)])
    section = DataSection(path=str(tmp_path / "t.jsonl"), max_length=64, token_budget=256, eval_prompts=2)
    data = TrainData(
        load_tokenized(section, tokenizer, tmp_path, tmp_path / "dc"), section, sets={"general": prompts}
    )
    assert data.eval_prompts(8, 3, "general") == [p[-8:] for p in prompts[:3]]
    with pytest.raises(ValueError, match="'other' was not loaded"):
        data.eval_prompts(8, 3, "other")


def test_a_set_prompt_is_what_precedes_the_first_reply(tokenizer, tmp_path: Path) -> None:
    """prompt_ids, of each format, against the held-out rule: the tokens before the first one that
    tokenize_record labels (its spans found another way: by rendering up to and through a reply)."""
    records = [
        {"messages": CHAT},
        {"conversations": [{"from": "human", "value": "say hi"}, {"from": "gpt", "value": "hi"}]},
        {"prompt": "def add(a, b):\n", "completion": "    return a + b\n"},
        {"text": tokenizer.apply_chat_template(CHAT, tokenize=False)},
    ]
    marks = template_marks(tokenizer)
    for record in records:
        row = tokenize_record(record, tokenizer, 512, marks=marks)
        ids, mask = row["input_ids"], row["loss_mask"]
        assert prompt_ids(record, record_format(record), tokenizer, "keep", marks) == ids[: mask.index(1)], (
            record
        )
    plain = train_tokenizer(TEXTS, vocab_size=300)
    plain.chat_template = None  # role: content lines
    row = tokenize_record(records[0], plain, 512)
    assert (
        prompt_ids(records[0], "messages", plain, "keep", None)
        == row["input_ids"][: row["loss_mask"].index(1)]
    )
    _write_jsonl(tmp_path / "mine.jsonl", [*records[:1], {"messages": CHAT[:2]}])
    mine = load_prompt_set(str(tmp_path / "mine.jsonl"), tokenizer, "keep", tmp_path / "dc")
    assert mine[0] == mine[1]  # a record without its replies has the same prompt
    with pytest.raises(ConfigError, match=r"eval.sets: .*absent.jsonl is not a file"):
        load_prompt_set(str(tmp_path / "absent.jsonl"), tokenizer, "keep", tmp_path / "dc")
    _write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "a", "completion": "b"}, {"question": "hello"}])
    with pytest.raises(ConfigError, match=r"eval.sets .*odd.jsonl line 2: a record of no known format"):
        load_prompt_set(str(tmp_path / "odd.jsonl"), tokenizer, "keep", tmp_path / "dc")
