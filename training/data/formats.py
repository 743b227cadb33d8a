"""The record formats the trainer reads, as their owners define them, and the one chat shape they
become before tokenizing.

  specforge   ``{"id", "conversations": [{"role": "system|user|assistant", "content"}, ...]}``
              (SpecForge ``docs/basic_usage/data_preparation.md``, "Conversation Format"; the
              output of its ``scripts/prepare_data.py`` and ``scripts/regenerate_train_data.py``,
              whose assistant turns may carry ``reasoning_content``)
  sharegpt    ``{"id", "conversations": [{"from": "system|human|gpt", "value"}, ...]}`` (raw
              ShareGPT; SpecForge ``specforge/data/parse.py`` ``Parser._normalize_message``: human
              and user are the user, gpt and assistant the assistant)
  text        ``{"id", "text"}`` with the target's chat template already applied ("Pre-formatted
              Text Format"); the loss covers what follows each assistant header through the
              end-of-turn marker (``GeneralParser.parse`` with ``preformatted``: the pattern
              ``assistant_header (.*?) (end_of_turn_token | end of text)``)
  messages    ``{"messages": [{"role", "content"}, ...]}`` (the OpenAI / TRL chat shape)
  completion  ``{"prompt", "completion"}`` (plain text: loss on the completion)

A file holds one format: ``record_format`` names each record's, and the loader refuses a data set
whose records disagree or fit none (``training.data.dataset``), naming the file, the line and the
keys found there.

Reasoning (``data.reasoning``): "keep" trains on the ``<think>`` block a reasoning target writes
(a ``reasoning_content`` field is handed to a template that reads it, else written inline as
``<think>\\n...\\n</think>\\n\\n`` before the answer); "drop" removes it (the field, and any
``<think>...</think>`` in the content) for a target served with thinking off.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMATS = ("specforge", "sharegpt", "text", "messages", "completion")
REASONING = ("keep", "drop")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def _turns(value: Any) -> list[dict[str, Any]] | None:
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        return None
    return value


def record_format(record: dict[str, Any]) -> str | None:
    """The format of one record (module docstring), or None when it fits none."""
    turns = _turns(record.get("conversations"))
    if turns is not None:
        if all(isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns):
            return "specforge"
        if all(t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str) for t in turns):
            return "sharegpt"
        return None
    if record.get("conversations") is not None:
        return None
    if _turns(record.get("messages")) is not None:
        turns = record["messages"]
        ok = all(isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns)
        return "messages" if ok else None
    if isinstance(record.get("text"), str):
        return "text"
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return "completion"
    return None


def keys_found(record: dict[str, Any]) -> list[str]:
    """The keys of a record that hold a value, with the keys of its first turn (``conversations.from``)."""
    found = []
    for key, value in record.items():
        if value is None:
            continue
        found.append(key)
        turns = _turns(value)
        if turns is not None:
            found.extend(f"{key}.{k}" for k, v in turns[0].items() if v is not None)
    return sorted(found)


def _reasoning(message: dict[str, Any], reasoning: str, template_reads_it: bool) -> dict[str, str]:
    out = {"role": message["role"], "content": message["content"]}
    thought = message.get("reasoning_content")
    if message["role"] != "assistant":
        return out
    if reasoning == "drop":
        out["content"] = _THINK.sub("", out["content"])
        return out
    if isinstance(thought, str) and thought:
        if template_reads_it:
            out["reasoning_content"] = thought
        else:
            out["content"] = f"<think>\n{thought}\n</think>\n\n{out['content']}"
    return out


def to_messages(record: dict[str, Any], fmt: str, reasoning: str, template: str) -> list[dict[str, str]]:
    """The chat messages of a specforge / sharegpt / messages record (roles user/assistant/system)."""
    if fmt == "sharegpt":
        turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]
    else:
        turns = record["conversations" if fmt == "specforge" else "messages"]
    reads = "reasoning_content" in (template or "")
    return [_reasoning(t, reasoning, reads) for t in turns]


def template_marks(tokenizer: Any) -> tuple[str, str]:
    """(assistant header, end of turn) of the tokenizer's chat template, read from two renderings
    of a probe conversation: what the generation prompt adds after a user turn is the header, what
    follows an assistant reply to the end is the end-of-turn marker (SpecForge names both per
    template in ``specforge/data/template.py``; here the target's own template says them)."""
    probe = "\x01fleet-probe\x01"
    user = [{"role": "user", "content": "hi"}]
    bare = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": probe}], tokenize=False, add_generation_prompt=False
    )
    if not prompt.startswith(bare) or probe not in full:
        raise ValueError("the chat template does not render a generation prompt after a user turn")
    header = prompt[len(bare) :]
    end = full[full.index(probe) + len(probe) :]
    if not header or not end:
        raise ValueError("the chat template marks no assistant header or end of turn")
    return header, end


def text_spans(text: str, header: str, end: str) -> list[tuple[int, int]]:
    """Character spans of the assistant replies of a pre-formatted text: after each ``header``
    through the next ``end`` (included), or to the end of the text."""
    pattern = re.escape(header) + r"(.*?(?:" + re.escape(end) + r"|$))"
    return [m.span(1) for m in re.finditer(pattern, text, re.DOTALL)]


def locate(files: Sequence[str], index: int) -> str:
    """``FILE line N`` (JSONL), ``FILE record N`` (JSON list), ``FILE row N`` (Parquet, a
    ``save_to_disk`` folder) of the ``index``-th record of the data set read from ``files`` in order."""
    import json

    for name in files:
        path = Path(name)
        if path.is_dir() or path.suffix == ".parquet":
            count = _rows(path)
            if index < count:
                return f"{path} row {index + 1}"
            index -= count
            continue
        with open(path, encoding="utf-8") as handle:
            head = handle.read(1)
            handle.seek(0)
            if head == "[":
                count = len(json.load(handle))
                if index < count:
                    return f"{path} record {index + 1}"
                index -= count
                continue
            for number, line in enumerate(handle, 1):
                if line.strip():
                    if index == 0:
                        return f"{path} line {number}"
                    index -= 1
    return f"{files[0]} record {index + 1}"


def _rows(path: Path) -> int:
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        return len(loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded)
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows
