"""Training data: local JSONL/JSON/Parquet or a ``save_to_disk`` folder -> token ids + loss mask,
cached by ``datasets``.

The record formats are ``training.data.formats``': conversations (SpecForge's role/content,
ShareGPT's from/value, ``messages``) rendered with the tokenizer's chat template, loss on the
assistant turns only; pre-formatted ``text``, loss on the spans its template marks as the
assistant's; ``prompt`` + ``completion``, loss on the completion (and EOS). Tokenization runs
through ``datasets.Dataset.map``, its cache in the data cache folder keyed by the files' content,
the tokenizer and the settings, so a resumed run does not tokenize again. ``TrainData`` joins the
tokenized set with the bucket planner (``training.data.buckets``) and assembles padded batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import ConfigError, DataSection
from training.data.buckets import EpochPlanner, Position
from training.data.corpus import build_default_corpus
from training.data.formats import (
    FORMATS,
    keys_found,
    locate,
    record_format,
    template_marks,
    text_spans,
    to_messages,
)


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


def _plain_line(message: dict[str, str]) -> str:
    """A message as a template-less tokenizer is given it: ``role: content`` and a newline."""
    return f"{message.get('role', '')}: {message.get('content', '')}\n"


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
        piece = _encode(tokenizer, _plain_line(message))
        assistant = message.get("role") == "assistant"
        if assistant and tokenizer.eos_token_id is not None:
            piece = [*piece, tokenizer.eos_token_id]
        ids.extend(piece)
        mask.extend([int(assistant)] * len(piece))
    return ids, mask


def tokenize_text(tokenizer: Any, text: str, marks: tuple[str, str]) -> tuple[list[int], list[int]]:
    """(ids, mask) of a pre-formatted text: mask 1 on the tokens that start inside an assistant
    reply (``training.data.formats.text_spans``: after the header, through the end of turn)."""
    spans = text_spans(text, *marks)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def tokenize_record(
    record: dict[str, Any],
    tokenizer: Any,
    max_length: int,
    reasoning: str = "keep",
    marks: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """One record of any format (``training.data.formats``) -> {"input_ids", "loss_mask",
    "length", "format", "dropped"}, truncated to ``max_length``. ``format`` is "" for a record that
    fits none (the loader refuses the data set); ``dropped`` says why a record cannot train ("" if
    it can): the loader leaves those out and the data report counts them."""
    fmt = record_format(record)
    if fmt is None:
        return {"input_ids": [], "loss_mask": [], "length": 0, "format": "", "dropped": "no known format"}
    if fmt == "completion":
        ids, mask = tokenize_completion(tokenizer, record["prompt"], record["completion"])
    elif fmt == "text":
        if marks is None:
            raise ValueError("pre-formatted text needs the target's chat template; the tokenizer has none")
        ids, mask = tokenize_text(tokenizer, record["text"], marks)
    else:
        template = getattr(tokenizer, "chat_template", None) or ""
        ids, mask = tokenize_chat(tokenizer, to_messages(record, fmt, reasoning, template))
    labelled = any(mask)
    ids, mask = ids[:max_length], mask[:max_length]
    dropped = ""
    if not labelled:
        dropped = "no assistant reply"
    elif not any(mask):
        dropped = "reply beyond max_length"
    elif len(ids) < 2:
        dropped = "shorter than 2 tokens"
    return {"input_ids": ids, "loss_mask": mask, "length": len(ids), "format": fmt, "dropped": dropped}


def prompt_ids(
    record: dict[str, Any], fmt: str, tokenizer: Any, reasoning: str, marks: tuple[str, str] | None
) -> list[int]:
    """The tokens the target is given before it first answers in a record of format ``fmt``: the
    turns before the first assistant turn (all of them where none is) rendered with the chat
    template and its generation prompt (``role: content`` lines without a template), a
    completion's prompt, a pre-formatted text through its first assistant header. Where a record
    has an assistant turn these are the tokens ``tokenize_record`` leaves out of the loss before
    it, the held-out split's prompts (``TrainData.eval_prompts``)."""
    if fmt == "completion":
        return _encode(tokenizer, record["prompt"])
    if fmt == "text":
        text = record["text"]
        spans = text_spans(text, *marks) if marks is not None else []
        return _encode(tokenizer, text[: spans[0][0]] if spans else text)
    template = getattr(tokenizer, "chat_template", None) or ""
    messages = to_messages(record, fmt, reasoning, template)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    if template:
        return _encode(tokenizer, _render(tokenizer, messages[:first], True))
    return _encode(tokenizer, "".join(_plain_line(m) for m in messages[:first]))


def data_files(data: DataSection, cache_dir: Path) -> tuple[str, list[str]]:
    """(reader, files) of the configured data, or the default corpus. The reader is a
    ``datasets`` builder name ("json", "parquet") or "disk" (a ``save_to_disk`` folder)."""
    if not data.path:
        corpus = build_default_corpus(
            cache_dir, data.corpus_files, data.corpus_chunk_lines, data.corpus_prompt_lines
        )
        return "json", [str(corpus)]
    root = Path(data.path).expanduser()
    saved = (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()
    if root.is_dir() and saved:  # a save_to_disk folder (a Dataset, or a DatasetDict: its train split)
        return "disk", [str(root)]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError(
            f"data.path {root} does not exist: give a local .jsonl/.json/.parquet file, a folder of "
            "them, or a datasets save_to_disk folder"
        )
    if not files:
        raise ConfigError(f"data.path {root}: no .jsonl/.json/.parquet files in it")
    kinds = {"parquet" if p.suffix == ".parquet" else "json" for p in files}
    if len(kinds) > 1:
        raise ConfigError(f"data.path {root}: mixes Parquet and JSON files; use one format")
    return kinds.pop(), [str(p) for p in files]


def content_key(files: Sequence[str], *parts: str) -> str:
    """sha256 over the bytes of the data files (a folder: its files, sorted) and ``parts``: the
    tokenized cache is keyed by what the data says, not by where it lies or when it was written,
    so a regenerated file that grows by a resume is tokenized again and an unchanged one is not."""
    digest = hashlib.sha256()
    for name in files:
        path = Path(name)
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            digest.update(member.name.encode() + b"\0")
            with open(member, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _read(reader: str, files: list[str], data_cache: Path, where: str, key: str = "data.path"):  # -> Dataset
    import datasets

    datasets.disable_progress_bars()
    try:
        if reader == "disk":
            loaded = datasets.load_from_disk(files[0])
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(f"a DatasetDict without a 'train' split (splits {sorted(loaded)})")
                loaded = loaded["train"]
            return loaded
        return datasets.load_dataset(reader, data_files=files, split="train", cache_dir=str(data_cache))
    except (ValueError, OSError, TypeError) as exc:
        raise ConfigError(f"{key} {where}: cannot read ({str(exc).splitlines()[0]:.160})") from None


def _marks(tokenizer: Any) -> tuple[str, str] | None:
    """The chat template's (assistant header, end of turn), or None without a usable template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        return None
    try:
        return template_marks(tokenizer)
    except Exception:  # a template that cannot render the probe: only text records need it
        return None


def tokenize_all(data: DataSection, tokenizer: Any, cache_dir: Path, data_cache: Path):  # -> (Dataset, str)
    """Every record tokenized (dropped ones included, with their reason) and the data set's one
    format. Refused (``ConfigError``, one line): a record of no known format (its file, line and
    keys), records of two formats, a format other than ``data.format``."""
    from datasets.fingerprint import Hasher

    reader, files = data_files(data, cache_dir)
    where = data.path or files[0]
    raw = _read(reader, files, data_cache, where)
    marks = _marks(tokenizer)
    if len(raw) and record_format(raw[0]) == "text" and marks is None:
        raise ConfigError(
            f"data.path {where}: pre-formatted text records need the target's chat template to find "
            "the assistant replies; the tokenizer has none (use conversations records instead)"
        )
    key = content_key(files, Hasher.hash(tokenizer), str(data.max_length), data.reasoning, "records-v2")
    tokenized = raw.map(
        tokenize_record,
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_length": data.max_length,
            "reasoning": data.reasoning,
            "marks": marks,
        },
        remove_columns=raw.column_names,
        num_proc=data.num_proc if data.num_proc > 1 else None,
        new_fingerprint=key,
        desc="tokenizing",
    )
    formats = tokenized["format"]
    first = formats[0] if formats else ""
    for index, fmt in enumerate(formats):
        if not fmt:
            raise ConfigError(
                f"data {locate(files, index)}: a record of no known format (keys found: "
                f"{', '.join(keys_found(raw[index])) or 'none'}); expected one of "
                f'{", ".join(FORMATS)} (docs/data.md "Training data")'
            )
        if fmt != first:
            raise ConfigError(
                f"data {locate(files, index)}: a {fmt} record after {first} records "
                f"({locate(files, 0)}); a data set of mixed formats is refused: convert it to one format"
            )
    if data.format != "auto" and first and first != data.format:
        raise ConfigError(
            f"data.path {where}: the records are {first}, but data.format = {data.format!r}; "
            "set data.format = 'auto' or give data of that format"
        )
    return tokenized, first


GENERAL_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "general-prompts.jsonl"


def eval_set_file(name: str) -> Path:
    """The file of an ``eval.sets`` entry that is not a split of the run's data: ``general``, the
    shipped set (``training/assets/README.md``), else the path it is."""
    return GENERAL_PROMPTS if name == "general" else Path(name).expanduser()


def load_prompt_set(name: str, tokenizer: Any, reasoning: str, data_cache: Path) -> list[list[int]]:
    """The prompts of the eval set ``name`` (``eval_set_file``), whole and in file order: each
    record's ``prompt_ids`` (a record of any format of ``training.data.formats``; one without a
    single prompt token is left out). Refused (``ConfigError``, one line): a missing file, one that
    cannot be read, a record of no known format (its file, line and keys)."""
    path = eval_set_file(name)
    if not path.is_file():
        raise ConfigError(
            f"eval.sets: {path} is not a file; give a .jsonl/.json/.parquet file of records, or drop it "
            "from eval.sets"
        )
    raw = _read(
        "parquet" if path.suffix == ".parquet" else "json", [str(path)], data_cache, str(path), "eval.sets"
    )
    marks = _marks(tokenizer)
    prompts: list[list[int]] = []
    for index, record in enumerate(raw):
        fmt = record_format(record)
        if fmt is None:
            raise ConfigError(
                f"eval.sets {locate([str(path)], index)}: a record of no known format (keys found: "
                f"{', '.join(keys_found(record)) or 'none'}); expected one of {', '.join(FORMATS)}"
            )
        ids = prompt_ids(record, fmt, tokenizer, reasoning, marks)
        if ids:
            prompts.append(ids)
    return prompts


def load_tokenized(data: DataSection, tokenizer: Any, cache_dir: Path, data_cache: Path):  # -> Dataset
    """The trainable tokenized records (columns input_ids, loss_mask, length), cached in ``data_cache``."""
    tokenized, _fmt = tokenize_all(data, tokenizer, cache_dir, data_cache)
    kept = f"{tokenized._fingerprint}-kept"
    trainable = tokenized.filter(lambda row: not row["dropped"], new_fingerprint=kept)
    return trainable.remove_columns(["format", "dropped"])


class TrainData:
    """Held-out eval prompts + length-bucketed, shuffled, resumable training batches."""

    def __init__(
        self,
        tokenized: Any,
        data: DataSection,
        eval_rows: Any = None,
        sets: Mapping[str, list[list[int]]] | None = None,
    ) -> None:
        self.sets = dict(sets or {})  # eval sets other than the run's splits: name -> whole prompts
        if eval_rows is not None:  # data.eval_path: the held-out records are another file's
            self.eval_rows, self.rows = eval_rows, tokenized
        else:
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

    def eval_prompts(self, prompt_tokens: int, count: int, split: str = "held_out") -> list[list[int]]:
        """Up to ``count`` held-out prompts (``split`` "train": of the training rows, spread over
        them; another eval set's name: its first ``count``, ``sets``): the last ``prompt_tokens``
        tokens before the first labelled one (at least one token), so a long prompt keeps its end
        (the chat turn that asks) instead of being cut after its first message."""
        if split not in ("held_out", "train"):
            if split not in self.sets:
                raise ValueError(
                    f"eval set {split!r} was not loaded (loaded: {', '.join(self.sets) or 'none'})"
                )
            return [ids[-max(1, prompt_tokens) :] for ids in self.sets[split][:count]]
        rows = self.eval_rows
        if split == "train":
            n, k = len(self.rows), min(count, len(self.rows))
            rows = self.rows.select([i * n // k for i in range(k)]) if k else self.rows
        prompts: list[list[int]] = []
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
            first_label = mask.index(1) if 1 in mask else len(ids)
            end = max(1, first_label)
            prompts.append(list(ids[max(0, end - max(1, prompt_tokens)) : end]))
            if len(prompts) >= count:
                break
        return prompts
