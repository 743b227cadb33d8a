"""training.contract: what the trainer writes and fleet reads (events, the bucket table, N+M)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.contract import (
    Bucket,
    BucketTable,
    Topology,
    find_bucket_table,
    format_bucket_table,
    parse_events,
    parse_topology,
    read_events,
    validate_event,
)

TABLE = BucketTable(10, 1, 8, 4.2, (Bucket(0, 0, 64, 7, 70.0), Bucket(1, 64, 129, 3, 30.0)))


def test_the_table_a_buckets_event_carries_is_the_table() -> None:
    fields = TABLE.event_fields()
    event = {"v": 1, "ts": 1.0, "event": "buckets", "rank": 0, "role": "single", **fields}
    assert validate_event(json.loads(json.dumps(event))) == []
    assert BucketTable.from_event(json.loads(json.dumps(fields))) == TABLE
    assert BucketTable.from_event({"batches_per_epoch": 10}) is None


def test_the_last_table_of_a_live_log_wins_whatever_surrounds_it() -> None:
    first = format_bucket_table(BucketTable(5, 1, 1, 1.0, (Bucket(0, 0, 64, 5, 100.0),)))
    rows = format_bucket_table(TABLE).splitlines()
    log = "\n".join(
        [
            first,
            "step 1 loss 3.0",
            f"[rank1]:2026-11-30 00:00:00 INFO {rows[0]}",  # a timestamp before the header
            f"[rank1]:{rows[1]}",
            "[rank0]:another rank's line between the rows",
            f"[rank1]:{rows[2]}\r",
        ]
    )
    assert find_bucket_table(log) == TABLE
    assert find_bucket_table("no table here\n") is None


def test_parse_events_keeps_what_a_reader_can_place_read_events_keeps_every_object(tmp_path: Path) -> None:
    good = {"v": 1, "ts": 2.0, "event": "phase", "rank": 0, "role": "single", "phase": "train"}
    foreign = {"v": 2, "ts": 2.0, "event": "phase"}
    text = "\n".join([json.dumps(good), json.dumps(foreign), "[1, 2]", '{"torn": '])
    parsed = parse_events(text)
    assert parsed.events == (good,) and parsed.skipped == 3
    path = tmp_path / "events.jsonl"
    path.write_text(text)
    assert read_events(path) == [good, foreign]


def test_topology_ranks_and_roles() -> None:
    topo = parse_topology(" 5 + 3 ")
    assert topo == Topology(5, 3) and str(topo) == "5+3" and topo.world_size == 8
    assert (topo.role_of(4), topo.role_of(5)) == (("target", 4), ("drafter", 0))
    assert topo.target_ranks == [0, 1, 2, 3, 4] and topo.drafter_ranks == [5, 6, 7]
    with pytest.raises(ValueError, match="outside topology 5\\+3"):
        topo.role_of(8)
    for bad in ("", "5", "0+3", "5+0", "5x3"):
        with pytest.raises(ValueError):
            parse_topology(bad)


def test_an_eval_events_tree_figures_are_read_and_checked() -> None:
    from training.contract import tree_figures

    tree = [{"budget": b, "tau_mean": t, "tau_prompt_mean": t, "hist": [1], "rounds": 2, "tree_size_mean": 9}
            for b, t in ((16, 2.5), (128, 3.0))]  # fmt: skip
    cost = {"device": "H200", "context": 96, "speedup": {"0": 1.2, "16": 1.5, "x": 9.0, "64": "fast"},
            "best_budget": 16, "best_speedup": 1.5}  # fmt: skip
    ev = {"v": 1, "ts": 1.0, "event": "eval", "rank": 0, "role": "single", "step": 7, "tau_mean": 2.0,
          "tau_hist": [1], "tau_estimate": 2.0, "tree": tree, "tree_cost": cost}  # fmt: skip
    assert validate_event(ev) == []
    assert validate_event({**ev, "tree_cost": [1]}) == ["eval.tree_cost: expected object, got [1]"]
    figures = tree_figures(ev)
    assert figures is not None and figures.taus == {0: 2.0, 16: 2.5, 128: 3.0}
    assert figures.speedups == {0: 1.2, 16: 1.5}  # entries that are not a budget and a number dropped
    assert (figures.reference_budget, figures.shown_budget, figures.best_budget) == (16, 16, 16)
    assert figures.context == 96
    assert figures.text() == "tree tau 2.50 @16, 1.25x chain; best budget 16: ~1.50x speedup modelled (H200)"
    best_big = tree_figures({**ev, "tree_cost": {**cost, "best_budget": 128, "best_speedup": 1.7}})
    assert best_big is not None and (best_big.reference_budget, best_big.shown_budget) == (16, 128)
    assert (
        best_big.text() == "tree tau 2.50 @16, 1.25x chain; best budget 128: ~1.70x speedup modelled (H200)"
    )
    # no cost: the largest budget up to 64 is shown; no tree: no figures
    plain = tree_figures({**ev, "tree_cost": None})
    assert plain is not None and plain.text() == "tree tau 2.50 @16, 1.25x chain"
    assert tree_figures({**ev, "tree": []}) is None and tree_figures({**ev, "step": None}) is None
