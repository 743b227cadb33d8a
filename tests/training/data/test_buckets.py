"""Length buckets: the user's table format (parsed from their real log), deterministic epoch plans."""

from __future__ import annotations

import numpy as np
import pytest

from training.data.buckets import (
    Bucket,
    BucketTable,
    EpochPlanner,
    Position,
    bucket_boundaries,
    bucket_table,
    format_bucket_table,
    parse_bucket_table,
    plan_epoch,
)

# The user's real start-up log, verbatim, with the lines around the table.
USER_LOG = """\
Batches per epoch: 46688 (min=2 max=64 avg=19.3)
  Bucket 0 [   0, 770):  2120 batches ( 4.5%)
  Bucket 1 [ 770,1216):  4016 batches ( 8.6%)
  Bucket 2 [1216,1728):  5470 batches ( 11.7%)
  Bucket 3 [1728,2432):  7493 batches ( 16.0%)
  Bucket 4 [2432,3296):  8009 batches ( 17.2%)
  Bucket 5 [3296,8193): 19580 batches ( 41.9%)
Loading 5 target models...
  Target 0 on cuda:0... Loading weights: 100%|██████████| 851/851 [00:03<00:00, 227.50it/s]
"""


def test_user_log_parses_and_prints_back_identically() -> None:
    table = parse_bucket_table(USER_LOG)
    assert (table.batches_per_epoch, table.min, table.max, table.avg) == (46688, 2, 64, 19.3)
    assert table.buckets[0] == Bucket(0, 0, 770, 2120, 4.5)
    assert table.buckets[5] == Bucket(5, 3296, 8193, 19580, 41.9)
    assert sum(b.batches for b in table.buckets) == table.batches_per_epoch
    assert format_bucket_table(table) == "\n".join(USER_LOG.splitlines()[:7])


def test_format_of_a_computed_table_parses_back() -> None:
    table = BucketTable(10, 1, 8, 4.25, (Bucket(0, 0, 64, 7, 70.0), Bucket(1, 64, 129, 3, 30.0)))
    text = format_bucket_table(table)
    assert text.splitlines()[1] == "  Bucket 0 [   0,  64):     7 batches ( 70.0%)"
    assert parse_bucket_table(text) == BucketTable(10, 1, 8, 4.2, table.buckets)  # avg printed .1f


def test_parse_without_a_header_fails() -> None:
    with pytest.raises(ValueError, match="Batches per epoch"):
        parse_bucket_table("  Bucket 0 [   0, 770):  2120 batches ( 4.5%)\n")


def test_boundaries_cover_all_lengths_and_end_after_max_length() -> None:
    lengths = np.random.default_rng(0).integers(2, 513, size=1000)
    edges = bucket_boundaries(lengths, 4, 512)
    assert edges[0] == 0 and edges[-1] == 513 and edges == sorted(set(edges))
    assert len(edges) - 1 <= 4


def test_epoch_plan_is_a_deterministic_partition_within_budget() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 257, size=500)
    edges = bucket_boundaries(lengths, 4, 256)
    plan = plan_epoch(lengths, edges, token_budget=1024, max_batch_size=6, seed=3, epoch=0)
    seen = np.concatenate([idx for _, idx in plan])
    assert set(seen.tolist()) == set(range(500))  # every sequence at least once per epoch
    sizes: dict[int, set[int]] = {}
    for bucket, idx in plan:
        assert len(idx) <= 6 and len(set(idx.tolist())) == len(idx)
        sizes.setdefault(bucket, set()).add(len(idx))
        assert all(edges[bucket] <= lengths[i] < edges[bucket + 1] for i in idx)
        assert len(idx) * min(edges[bucket + 1], 256) <= 1024 or len(idx) == 1
    again = plan_epoch(lengths, edges, 1024, 6, seed=3, epoch=0)
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(plan, again, strict=True))
    other = plan_epoch(lengths, edges, 1024, 6, seed=3, epoch=1)
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(plan, other, strict=False))
    table = bucket_table(plan, edges)
    assert sum(b.batches for b in table.buckets) == table.batches_per_epoch == len(plan)
    assert table.min >= 1 and table.max <= 6
    # One batch size per bucket (tail batches topped up): one compiled shape per bucket.
    assert all(len(s) == 1 for s in sizes.values()), sizes
    # Only a tail's top-up repeats sequences: at most one batch's worth per bucket.
    repeats = len(seen) - 500
    assert 0 < repeats < 6 * len(sizes)


def test_a_bucket_smaller_than_one_batch_is_one_batch_without_repeats() -> None:
    lengths = np.array([10, 11, 12, 100, 101, 102, 103, 104, 105, 106])
    edges = [0, 64, 129]
    plan = plan_epoch(lengths, edges, token_budget=128 * 4, max_batch_size=64, seed=0, epoch=0)
    short = [idx for b, idx in plan if b == 0]
    assert len(short) == 1 and sorted(short[0].tolist()) == [0, 1, 2]
    long = [idx for b, idx in plan if b == 1]
    assert [len(idx) for idx in long] == [4, 4]  # 7 sequences: 4 + (3 topped up to 4)
    assert set(np.concatenate(long).tolist()) == set(range(3, 10))


def test_planner_position_rolls_over_epochs() -> None:
    planner = EpochPlanner(np.array([5, 6, 7, 30, 31]), 2, 32, 64, 2, seed=0)
    n = planner.table().batches_per_epoch
    position = Position()
    taken = []
    for _ in range(n + 1):
        _, idx, at, position = planner.take(position)
        taken.append((at, idx.tolist()))
    assert taken[n][0] == Position(1, 0)
    assert {i for _, idx in taken[:n] for i in idx} == {0, 1, 2, 3, 4}
    # Taking from a saved position gives the same batch as getting there step by step.
    _, idx, at, _ = planner.take(Position(0, n))
    assert at == Position(1, 0) and idx.tolist() == taken[n][1]
