"""Training data: local JSONL/Parquet -> token ids + loss mask, cached by ``datasets``.

Two record shapes are accepted:
  chat        ``{"messages": [{"role": ..., "content": ...}, ...]}`` — rendered with the
              tokenizer's chat template when it has one; loss on assistant turns only.
  completion  ``{"prompt": ..., "completion": ...}`` — prompt tokens, then completion tokens
              and EOS; loss on the completion (and EOS) only.
Tokenization runs through ``datasets.Dataset.map`` with its cache in the run's data cache
folder, so a resumed run does not tokenize again. ``TrainData`` joins the tokenized set with
the bucket planner (``training.data.buckets``) and assembles padded batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import ConfigError, DataSection
from training.data.buckets import EpochPlanner, Position
from training.data.corpus import build_default_corpus


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B] long
    bucket: int
    position: Position  # where this batch was taken (epoch, index)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(ids, mask): prompt ids (mask 0), completion ids + EOS (mask 1)."""
    prompt_ids = _encode(tokenizer, prompt)
    completion_ids = _encode(tokenizer, completion)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = prompt_ids + completion_ids + eos
    mask = [0] * len(prompt_ids) + [1] * (len(completion_ids) + len(eos))
    return ids, mask


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def tokenize_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation; mask 1 on the tokens of assistant turns (with their end marker).

    With a chat template, the assistant spans are found by rendering the conversation up to
    each assistant turn (with the generation prompt) and up to its end; a template that does
    not render prefixes consistently leaves that turn unlabelled rather than mislabelled.
    Without a template: ``role: content`` lines joined, EOS after each assistant turn.

    Thinking (Qwen3.5/3.6 templates, ``<think>``): the labels are what the target generates
    after its generation prompt ``<|im_start|>assistant\n<think>\n``: the reasoning, ``</think>``,
    the answer and ``<|im_end|>\n``. The drafter must draft the reasoning, most of what a
    thinking model emits, so it is in the loss; the ``<think>\n`` opener is part of the prompt
    (the template writes it, the model does not), so it is not. An assistant turn before the
    last user message is rendered without its reasoning; the target never produces an answer
    without thinking first, so that rendering is not trained on: its prefix check fails and it
    stays unlabelled. This is SpecForge's rule for these models (``specforge/data/template.py``
    ``qwen3.5``: ``assistant_header`` ``<|im_start|>assistant\n<think>\n``, loss through
    ``<|im_end|>\n``; ``tests/test_scripts/test_expand_reasoning_conversations.py``: the history
    answer is out of the loss, the last turn's reasoning in).
    """
    if getattr(tokenizer, "chat_template", None):
        full = _render(tokenizer, messages, False)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = _render(tokenizer, messages[:i], True) if i else ""
            through = _render(tokenizer, messages[: i + 1], False)
            if full.startswith(through) and through.startswith(before):
                spans.append((len(before), len(through)))
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
        return ids, mask
    ids, mask = [], []
    for message in messages:
        piece = _encode(tokenizer, f"{message.get('role', '')}: {message.get('content', '')}\n")
        assistant = message.get("role") == "assistant"
        if assistant and tokenizer.eos_token_id is not None:
            piece = [*piece, tokenizer.eos_token_id]
        ids.extend(piece)
        mask.extend([int(assistant)] * len(piece))
    return ids, mask


def tokenize_record(record: dict[str, Any], tokenizer: Any, max_length: int) -> dict[str, Any]:
    """One record -> {"input_ids", "loss_mask", "length"}, truncated to ``max_length``."""
    if record.get("messages") is not None:
        ids, mask = tokenize_chat(tokenizer, record["messages"])
    elif record.get("prompt") is not None and record.get("completion") is not None:
        ids, mask = tokenize_completion(tokenizer, record["prompt"], record["completion"])
    else:
        raise ValueError("record has neither 'messages' nor 'prompt' + 'completion'")
    ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask, "length": len(ids)}


def data_files(data: DataSection, cache_dir: Path) -> tuple[str, list[str]]:
    """(datasets builder name, files) of the configured data, or the default corpus."""
    if not data.path:
        corpus = build_default_corpus(
            cache_dir, data.corpus_files, data.corpus_chunk_lines, data.corpus_prompt_lines
        )
        return "json", [str(corpus)]
    root = Path(data.path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError(f"data.path {root} does not exist: give a local .jsonl/.parquet file or folder")
    if not files:
        raise ConfigError(f"data.path {root}: no .jsonl/.json/.parquet files in it")
    kinds = {"parquet" if p.suffix == ".parquet" else "json" for p in files}
    if len(kinds) > 1:
        raise ConfigError(f"data.path {root}: mixes Parquet and JSON files; use one format")
    return kinds.pop(), [str(p) for p in files]


def load_tokenized(data: DataSection, tokenizer: Any, cache_dir: Path, data_cache: Path):  # -> Dataset
    """The tokenized data set (columns input_ids, loss_mask, length); cached in ``data_cache``."""
    import datasets

    builder, files = data_files(data, cache_dir)
    datasets.disable_progress_bars()
    try:
        raw = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(data_cache))
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"data.path {data.path or files[0]}: cannot read ({str(exc).splitlines()[0]:.160})"
        ) from None
    columns = set(raw.column_names)
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        raise ConfigError(
            f"data.path {data.path or files[0]}: records need 'messages' or 'prompt' + 'completion'; "
            f"found columns {sorted(columns)}"
        )
    tokenized = raw.map(
        tokenize_record,
        fn_kwargs={"tokenizer": tokenizer, "max_length": data.max_length},
        remove_columns=raw.column_names,
        num_proc=data.num_proc if data.num_proc > 1 else None,
        desc="tokenizing",
    )
    # Drop what cannot train: too short to hold an anchor and a label, or nothing labelled.
    return tokenized.filter(lambda row: row["length"] >= 2 and any(row["loss_mask"]))


class TrainData:
    """Held-out eval prompts + length-bucketed, shuffled, resumable training batches."""

    def __init__(self, tokenized: Any, data: DataSection) -> None:
        n = len(tokenized)
        held = min(data.eval_prompts, max(0, n - 1))
        order = np.random.default_rng([data.seed, 7919]).permutation(n)
        self.eval_rows = tokenized.select(sorted(order[:held].tolist()))
        self.rows = tokenized.select(sorted(order[held:].tolist()))
        self.planner = EpochPlanner(
            np.asarray(self.rows["length"]),
            data.num_buckets,
            data.max_length,
            data.token_budget,
            data.max_batch_size,
            data.seed,
        )

    @property
    def num_sequences(self) -> int:
        return len(self.rows)

    def batch(self, position: Position, pad_id: int, pad_to_bucket: bool) -> tuple[Batch, Position]:
        """The batch at ``position`` and the position after it."""
        bucket, indices, at, after = self.planner.take(position)
        rows = self.rows[[int(i) for i in indices]]
        lengths = [len(x) for x in rows["input_ids"]]
        width = self.planner.width(bucket, lengths, pad_to_bucket)
        ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(lengths), width), dtype=torch.bool)
        for r, (seq, seq_mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
            ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[r, : len(seq)] = torch.tensor(seq_mask, dtype=torch.bool)
        batch = Batch(ids, mask, torch.tensor(lengths, dtype=torch.long), bucket, at)
        return batch, after

    def eval_prompts(self, prompt_tokens: int, count: int) -> list[list[int]]:
        """Up to ``count`` held-out prompts: the last ``prompt_tokens`` tokens before the first
        labelled one (at least one token), so a long prompt keeps its end (the chat turn that
        asks) instead of being cut after its first message."""
        prompts: list[list[int]] = []
        for ids, mask in zip(self.eval_rows["input_ids"], self.eval_rows["loss_mask"], strict=True):
            first_label = mask.index(1) if 1 in mask else len(ids)
            end = max(1, first_label)
            prompts.append(list(ids[max(0, end - max(1, prompt_tokens)) : end]))
            if len(prompts) >= count:
                break
        return prompts
