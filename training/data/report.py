"""The data report: what a run will train on, before it loads a model (``python -m training data``,
``fab data``): records, tokens, dropped records and why, the length histogram and the bucket plan
the run will use (the table its log prints at start-up, here without waiting for it)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.config import RunConfig
from training.contract import BucketTable, format_bucket_table


@dataclass(frozen=True)
class DataReport:
    source: str  # the data path, or what the run builds ("regenerated: ...", "default corpus")
    format: str
    records: int
    kept: int
    eval_held_out: int
    tokens: int  # of the kept records
    loss_tokens: int
    dropped: dict[str, int]  # reason -> records
    histogram: list[tuple[int, int, int]]  # (lo, hi, records) of the kept lengths
    buckets: BucketTable | None
    note: str = ""

    def text(self) -> str:
        lines = [f"data: {self.source}"]
        if self.note:
            return "\n".join([*lines, self.note])
        lines.append(
            f"format {self.format}: {self.records} records, {self.kept} kept ({self.eval_held_out} held out "
            f"for eval), {self.tokens} tokens, {self.loss_tokens} in the loss"
        )
        for reason, n in sorted(self.dropped.items()):
            lines.append(f"dropped {n}: {reason}")
        if self.histogram:
            lines.append("lengths (tokens):")
            peak = max(n for _, _, n in self.histogram) or 1
            for lo, hi, n in self.histogram:
                lines.append(f"  [{lo:>5},{hi:>5}) {n:>7}  {'#' * max(0, round(40 * n / peak))}")
        if self.buckets is not None:
            lines.append(format_bucket_table(self.buckets))
        return "\n".join(lines)

    def to_json(self) -> str:
        fields = asdict(self)
        fields["buckets"] = self.buckets.event_fields() if self.buckets is not None else None
        return json.dumps(fields, sort_keys=True)


def length_histogram(lengths: np.ndarray, max_length: int) -> list[tuple[int, int, int]]:
    """Counts over powers-of-two edges from 32 up to ``max_length`` (the last edge)."""
    edges = [0]
    edge = 32
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    edges.append(max_length + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    return [(edges[i], edges[i + 1], int(n)) for i, n in enumerate(counts)]


def build_report(config: RunConfig, tokenizer: Any, cache_dir: Path, data_cache: Path) -> DataReport:
    """The report of ``config``'s data (tokenized through the run's own cache, so the run reuses it)."""
    from training.data.dataset import TrainData, tokenize_all

    tokenized, fmt = tokenize_all(config.data, tokenizer, cache_dir, data_cache)
    dropped = Counter(r for r in tokenized["dropped"] if r)
    kept = tokenized.filter(lambda row: not row["dropped"]).remove_columns(["format", "dropped"])
    lengths = np.asarray(kept["length"], dtype=np.int64)
    loss_tokens = int(sum(sum(m) for m in kept["loss_mask"]))
    table = None
    held = 0
    if len(kept):
        train = TrainData(kept, config.data)
        table = train.planner.table()
        held = len(train.eval_rows)
    return DataReport(
        source=config.data.path or "default corpus",
        format=fmt,
        records=len(tokenized),
        kept=len(kept),
        eval_held_out=held,
        tokens=int(lengths.sum()),
        loss_tokens=loss_tokens,
        dropped=dict(dropped),
        histogram=length_histogram(lengths, config.data.max_length),
        buckets=table,
    )
