"""Length buckets, the epoch plan and the resumable batch loader.

Sequences are grouped into length buckets; each bucket is cut into batches that fit a token
budget (padded length x sequences), and all batches of an epoch are shuffled together. The
plan of epoch ``e`` depends only on (lengths, boundaries, budget, seed, e), so a position
(epoch, batch index) is all a checkpoint needs to resume on exactly the next batch.

The start-up table is printed in the user's format and parsed back by fleet: both halves are
``training.contract``'s (``format_bucket_table``, ``parse_bucket_table``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from training.contract import Bucket, BucketTable, format_bucket_table, parse_bucket_table  # noqa: F401


def bucket_boundaries(lengths: Sequence[int] | np.ndarray, num_buckets: int, max_length: int) -> list[int]:
    """Bucket edges [0, e1, ..., max_length + 1] at length quantiles, rounded to a tile.

    The tile (8..128 tokens) keeps padded shapes few and aligned; duplicates collapse, so
    short corpora may get fewer buckets than asked for.
    """
    lengths = np.asarray(lengths)
    tile = 8
    while tile < 128 and tile * 64 < max_length:
        tile *= 2
    edges = [0]
    for q in np.linspace(0, 1, num_buckets + 1)[1:-1]:
        edge = int(np.ceil(np.quantile(lengths, q) / tile) * tile) if len(lengths) else 0
        if edges[-1] < edge < max_length:  # the last bucket always ends at max_length + 1
            edges.append(edge)
    edges.append(max_length + 1)
    return edges


def pad_length(lo: int, hi: int, max_length: int) -> int:
    """The fixed padded length of a bucket [lo, hi): ``hi`` (tile-aligned), the last one max_length."""
    del lo
    return min(hi, max_length)


def plan_epoch(
    lengths: np.ndarray,
    boundaries: Sequence[int],
    token_budget: int,
    max_batch_size: int,
    seed: int,
    epoch: int,
) -> list[tuple[int, np.ndarray]]:
    """The batches of one epoch, in order: (bucket index, sequence indices)."""
    rng = np.random.default_rng([seed, epoch])
    which = np.searchsorted(np.asarray(boundaries), lengths, side="right") - 1
    batches: list[tuple[int, np.ndarray]] = []
    max_length = boundaries[-1] - 1
    for b in range(len(boundaries) - 1):
        members = np.flatnonzero(which == b)
        if len(members) == 0:
            continue
        members = rng.permutation(members)
        padded = pad_length(boundaries[b], boundaries[b + 1], max_length)
        per_batch = max(1, min(max_batch_size, token_budget // padded))
        for start in range(0, len(members), per_batch):
            batch = members[start : start + per_batch]
            if len(batch) < per_batch <= len(members):
                # The tail batch is topped up with the bucket's first sequences of this epoch, so
                # every batch of a bucket has one shape: one compile per bucket, never a tail's
                # extra one. A bucket smaller than one batch is a single batch anyway.
                batch = np.concatenate([batch, members[: per_batch - len(batch)]])
            batches.append((b, batch))
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def bucket_table(plan: list[tuple[int, np.ndarray]], boundaries: Sequence[int]) -> BucketTable:
    """The table of one epoch's plan."""
    counts = [0] * (len(boundaries) - 1)
    for bucket, _ in plan:
        counts[bucket] += 1
    sizes = [len(idx) for _, idx in plan]
    total = len(plan)
    buckets = tuple(
        Bucket(i, boundaries[i], boundaries[i + 1], n, round(100.0 * n / total, 1) if total else 0.0)
        for i, n in enumerate(counts)
    )
    return BucketTable(
        batches_per_epoch=total,
        min=min(sizes) if sizes else 0,
        max=max(sizes) if sizes else 0,
        avg=round(float(np.mean(sizes)), 1) if sizes else 0.0,
        buckets=buckets,
    )


@dataclass(frozen=True)
class Position:
    """Where the loader is: the next batch is batch ``index`` of epoch ``epoch``."""

    epoch: int = 0
    index: int = 0


class EpochPlanner:
    """Batches of every epoch from fixed lengths; iterate with a resumable ``Position``."""

    def __init__(
        self,
        lengths: np.ndarray,
        num_buckets: int,
        max_length: int,
        token_budget: int,
        max_batch_size: int,
        seed: int,
    ) -> None:
        if len(lengths) == 0:
            raise ValueError("no training sequences: the data set is empty after tokenization")
        self.lengths = np.asarray(lengths)
        self.max_length = max_length
        self.boundaries = bucket_boundaries(self.lengths, num_buckets, max_length)
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        self.seed = seed
        self._cache: tuple[int, list[tuple[int, np.ndarray]]] | None = None

    def plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        if self._cache is None or self._cache[0] != epoch:
            plan = plan_epoch(
                self.lengths, self.boundaries, self.token_budget, self.max_batch_size, self.seed, epoch
            )
            self._cache = (epoch, plan)
        return self._cache[1]

    def table(self) -> BucketTable:
        return bucket_table(self.plan(0), self.boundaries)

    def padded_length(self, bucket: int) -> int:
        return pad_length(self.boundaries[bucket], self.boundaries[bucket + 1], self.max_length)

    def width(self, bucket: int, lengths: Sequence[int], pad_to_bucket: bool) -> int:
        """A batch's padded width: its bucket's (compiled runs: one shape per bucket) or its longest row."""
        return self.padded_length(bucket) if pad_to_bucket else int(max(lengths))

    def take(self, position: Position) -> tuple[int, np.ndarray, Position, Position]:
        """The batch at ``position`` (rolling over to the next epoch at the end):
        (bucket, indices, the position it was taken at, the position after it)."""
        plan = self.plan(position.epoch)
        if position.index >= len(plan):
            position = Position(position.epoch + 1, 0)
            plan = self.plan(position.epoch)
        bucket, indices = plan[position.index]
        return bucket, indices, position, Position(position.epoch, position.index + 1)
