"""Thinking models (Qwen3.5/3.6): what of a conversation with <think> blocks is in the loss.

The tokenizer is built here (``train_tokenizer(thinking=True)``: ``<think>``/``</think>`` and the
Qwen3.5-style chat template of ``training.model.tinymodel``). The mask of ``tokenize_chat`` is
compared with an independent implementation of SpecForge's rule for these models
(``specforge/data/template.py`` ``qwen3.5`` + ``specforge/data/parse.py`` ``GeneralParser``): every
span that starts after ``<|im_start|>assistant\\n<think>\\n`` and runs through the next
``<|im_end|>\\n`` is labelled, nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from training.config import DataSection
from training.data.dataset import load_tokenized, tokenize_chat
from training.model.tinymodel import train_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The user asks for a sum. I should add the numbers.\n",
    "Let me think about the loop first, then print.\n",
] * 20
HEADER = "<|im_start|>assistant\n<think>\n"
END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300, thinking=True)


def specforge_mask(tokenizer, text: str) -> list[int]:
    """SpecForge's qwen3.5 rule, re-implemented: labelled = the characters after each assistant
    header (which includes ``<think>\\n``) through the end-of-turn token; a token is labelled when
    it starts inside such a span (our tokenizer never merges across the span edges)."""
    spans = [
        (m.start(1), m.end(1))
        for m in re.finditer(re.escape(HEADER) + r"([\s\S]*?(?:" + re.escape(END) + "|$))", text)
    ]
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]


def labelled(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "add two numbers"},
    {"role": "assistant", "reasoning_content": "The user asks for a sum.", "content": "def add(a, b):"},
    {"role": "user", "content": "and print"},
    {"role": "assistant", "reasoning_content": "Let me think about the loop.", "content": "print(i)"},
]


def test_template_renders_qwen3_5_thinking(tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # The history turn loses its reasoning; the last turn keeps it inside <think>.
    assert "<|im_start|>assistant\ndef add(a, b):<|im_end|>\n" in text
    assert "The user asks for a sum." not in text
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nLet me think about the loop.\n</think>\n\nprint(i)<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(HEADER)
    no_think = tokenizer.apply_chat_template(
        CONVERSATION[:4], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (
        tokenizer.convert_tokens_to_ids("<think>") in ids
        and tokenizer.convert_tokens_to_ids("</think>") in ids
    )


def test_reasoning_of_the_generated_turn_is_in_the_loss_history_answers_are_not(tokenizer) -> None:
    ids, mask = tokenize_chat(tokenizer, CONVERSATION)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert mask == specforge_mask(tokenizer, text)
    assert labelled(tokenizer, ids, mask) == "Let me think about the loop.\n</think>\n\nprint(i)<|im_end|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        # reasoning written inline in content, as generated text often is
        [
            {"role": "user", "content": "add two numbers"},
            {"role": "assistant", "content": "<think>\nThe user asks for a sum.\n</think>\n\ndef add(a, b):"},
        ],
        # no reasoning: the empty block is the template's, the answer is labelled
        [{"role": "user", "content": "add"}, {"role": "assistant", "content": "def add(a, b):"}],
        # a multi-step tool exchange after the last user message: both turns keep their reasoning
        [
            {"role": "user", "content": "add two numbers"},
            {"role": "assistant", "reasoning_content": "I should add the numbers.", "content": "call"},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "reasoning_content": "The user asks for a sum.", "content": "3"},
        ],
        # a turn with reasoning followed by a later user turn: out of the loss
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "reasoning_content": "I should add.", "content": "a + b"},
            {"role": "user", "content": "print"},
            {"role": "assistant", "content": "print(i)"},
        ],
    ],
)
def test_masks_match_the_specforge_rule(tokenizer, messages: list[dict]) -> None:
    ids, mask = tokenize_chat(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert mask == specforge_mask(tokenizer, text)
    assert any(mask)
    assert "<think>" not in labelled(tokenizer, ids, mask)  # the opener is prompt, never a label


def test_jsonl_conversations_with_reasoning_through_datasets(tokenizer, tmp_path: Path) -> None:
    """``datasets`` fills missing keys of a message with None (a struct column): the template
    must treat ``reasoning_content: null`` as absent."""
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION[:3]}) + "\n"
    )
    data = DataSection(path=str(path), max_length=256, token_budget=512, eval_prompts=0)
    rows = load_tokenized(data, tokenizer, tmp_path / "cache", tmp_path / "data-cache")
    assert len(rows) == 2
    first = rows[0]
    assert labelled(tokenizer, first["input_ids"], first["loss_mask"]) == (
        "Let me think about the loop.\n</think>\n\nprint(i)<|im_end|>\n"
    )
    second = rows[1]  # its only assistant turn is the last one: reasoning kept and labelled
    assert labelled(tokenizer, second["input_ids"], second["loss_mask"]) == (
        "The user asks for a sum.\n</think>\n\ndef add(a, b):<|im_end|>\n"
    )
