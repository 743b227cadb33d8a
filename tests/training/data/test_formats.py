"""The user's own data: SpecForge's conversation format, ShareGPT, pre-formatted text, messages and
prompt + completion, as JSONL, JSON, Parquet and a ``save_to_disk`` folder, through the trainer's
real loader (``load_tokenized``).

One hand-made multi-turn conversation (system, two user turns, two replies) is written in each
format. The expected loss mask is written out here by hand from the ChatML template of the test
tokenizer (``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``): the labelled tokens are exactly the two
replies, each with its ``<|im_end|>\\n`` (SpecForge's rule: after the assistant header through the
end-of-turn token), and everything else, decoded, is the rest of the hand-written rendering.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import ConfigError, DataSection
from training.data.dataset import load_tokenized, tokenize_all
from training.data.formats import record_format, template_marks
from training.model.tinymodel import train_tokenizer

TEXTS = [
    "You are terse. Add two numbers. def add(a, b): return a + b\n",
    "Now print it. print(add(1, 2)) The user asks and the assistant answers.\n",
] * 20
SYSTEM, U1, A1, U2, A2 = (
    "You are terse.",
    "Add two numbers.",
    "def add(a, b): return a + b",
    "Now print it.",
    "print(add(1, 2))",
)
RENDERED = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n"
    f"<|im_start|>assistant\n{A1}<|im_end|>\n<|im_start|>user\n{U2}<|im_end|>\n"
    f"<|im_start|>assistant\n{A2}<|im_end|>\n"
)
LABELLED = f"{A1}<|im_end|>\n{A2}<|im_end|>\n"
UNLABELLED = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n"
    f"<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n"
)
ROLES = [("system", SYSTEM), ("user", U1), ("assistant", A1), ("user", U2), ("assistant", A2)]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}
RECORDS = {
    "specforge": {"id": "c1", "conversations": [{"role": r, "content": c} for r, c in ROLES]},
    "sharegpt": {"id": "c1", "conversations": [{"from": SHAREGPT[r], "value": c} for r, c in ROLES]},
    "messages": {"messages": [{"role": r, "content": c} for r, c in ROLES]},
    "text": {"id": "c1", "text": RENDERED},
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=400)


def _split(tokenizer, ids: list[int], mask: list[int]) -> tuple[str, str, int]:
    """(labelled text, unlabelled text, number of labelled runs)."""
    on = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    off = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    runs = sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))
    return on, off, runs


def _write(path: Path, records: list[dict], kind: str) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records))
    else:
        import datasets

        table = datasets.Dataset.from_list(records)
        if kind == "parquet":
            table.to_parquet(str(path))
        elif kind == "disk":
            table.save_to_disk(str(path))
        else:
            datasets.DatasetDict({"train": table}).save_to_disk(str(path))
    return path


def test_the_test_tokenizer_marks_chatml(tokenizer) -> None:
    assert template_marks(tokenizer) == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert tokenizer.decode(tokenizer(RENDERED, add_special_tokens=False)["input_ids"]) == RENDERED


@pytest.mark.parametrize("fmt", sorted(RECORDS))
def test_each_format_labels_exactly_the_replies(tokenizer, tmp_path: Path, fmt: str) -> None:
    record = RECORDS[fmt]
    assert record_format(record) == fmt
    path = _write(tmp_path / "data.jsonl", [record, record], "jsonl")
    data = DataSection(path=str(path), max_length=256)
    rows, found = tokenize_all(data, tokenizer, tmp_path, tmp_path / "dc")
    assert found == fmt
    ids, mask = rows[0]["input_ids"], rows[0]["loss_mask"]
    assert tokenizer.decode(ids) == RENDERED
    assert _split(tokenizer, ids, mask) == (LABELLED, UNLABELLED, 2)


@pytest.mark.parametrize("kind", ["json", "parquet", "disk", "disk-dict"])
def test_json_parquet_and_save_to_disk_read_the_same(tokenizer, tmp_path: Path, kind: str) -> None:
    name = {"json": "data.json", "parquet": "data.parquet", "disk": "saved", "disk-dict": "saved-dict"}[kind]
    path = _write(tmp_path / name, [RECORDS["sharegpt"]] * 3, kind)
    rows = load_tokenized(DataSection(path=str(path), max_length=256), tokenizer, tmp_path, tmp_path / "dc")
    assert len(rows) == 3
    assert _split(tokenizer, rows[2]["input_ids"], rows[2]["loss_mask"]) == (LABELLED, UNLABELLED, 2)


def test_completion_format_labels_the_completion(tokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", [{"prompt": U1, "completion": A1}], "jsonl")
    rows, fmt = tokenize_all(
        DataSection(path=str(path), max_length=256), tokenizer, tmp_path, tmp_path / "dc"
    )
    assert fmt == "completion"
    on, off, runs = _split(tokenizer, rows[0]["input_ids"], rows[0]["loss_mask"])
    assert (on, off, runs) == (f"{A1}<|endoftext|>", U1, 1)


def test_a_record_of_no_format_names_file_line_and_keys(tokenizer, tmp_path: Path) -> None:
    records = [RECORDS["specforge"], {"id": "x", "question": "hi", "answer": "yo"}]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"bad\.jsonl line 3: a record of no known format \(keys found: answer, id, question\)",
    ):
        load_tokenized(DataSection(path=str(path)), tokenizer, tmp_path, tmp_path / "dc")


def test_a_file_of_mixed_formats_is_refused(tokenizer, tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mixed.jsonl", [RECORDS["specforge"], RECORDS["specforge"], RECORDS["sharegpt"]], "jsonl"
    )
    with pytest.raises(
        ConfigError,
        match=r"mixed\.jsonl line 3: a sharegpt record after specforge records .*mixed formats is refused",
    ):
        load_tokenized(DataSection(path=str(path)), tokenizer, tmp_path, tmp_path / "dc")


def test_data_format_setting_is_enforced(tokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "s.jsonl", [RECORDS["sharegpt"]], "jsonl")
    with pytest.raises(ConfigError, match=r"the records are sharegpt, but data\.format = 'specforge'"):
        load_tokenized(DataSection(path=str(path), format="specforge"), tokenizer, tmp_path, tmp_path / "dc")


def test_reasoning_kept_inline_or_dropped(tokenizer, tmp_path: Path) -> None:
    turns = [
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1, "reasoning_content": "Add them."},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": f"<think>\nSimple.\n</think>\n\n{A2}"},
    ]
    path = _write(tmp_path / "r.jsonl", [{"id": "r", "conversations": turns}], "jsonl")
    kept, _ = tokenize_all(DataSection(path=str(path), max_length=256), tokenizer, tmp_path, tmp_path / "k")
    on, _, _ = _split(tokenizer, kept[0]["input_ids"], kept[0]["loss_mask"])
    assert (
        on
        == f"<think>\nAdd them.\n</think>\n\n{A1}<|im_end|>\n<think>\nSimple.\n</think>\n\n{A2}<|im_end|>\n"
    )
    drop = DataSection(path=str(path), max_length=256, reasoning="drop")
    dropped, _ = tokenize_all(drop, tokenizer, tmp_path, tmp_path / "d")
    assert _split(tokenizer, dropped[0]["input_ids"], dropped[0]["loss_mask"])[0] == LABELLED


def test_drops_are_counted_with_their_reason(tokenizer, tmp_path: Path) -> None:
    no_reply = {"id": "n", "conversations": [{"role": "user", "content": U1}]}
    long_prompt = {
        "id": "l",
        "conversations": [{"role": "user", "content": U1 * 40}, {"role": "assistant", "content": A1}],
    }
    path = _write(tmp_path / "d.jsonl", [RECORDS["specforge"], no_reply, long_prompt], "jsonl")
    data = DataSection(path=str(path), max_length=64)
    rows, _ = tokenize_all(data, tokenizer, tmp_path, tmp_path / "dc")
    assert rows["dropped"] == ["", "no assistant reply", "reply beyond max_length"]
    assert len(load_tokenized(data, tokenizer, tmp_path, tmp_path / "dc")) == 1
