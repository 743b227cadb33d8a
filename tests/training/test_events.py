"""The events.jsonl contract: the writer's lines validate, the validator catches what breaks it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from training.events import EVENT_FIELDS, EventWriter, read_events, validate_event, validate_line

GOOD_STEP = {
    "step": 3,
    "total_steps": 10,
    "epoch": 0,
    "loss": 5.5,
    "acc": [0.5, 0.25],
    "tau": 1.6,
    "lr": 1e-3,
    "tokens_per_s": 1234.5,
    "grad_norm": 0.7,
    "mem_gib": 0.0,
}


def test_writer_lines_validate_and_carry_common_fields(tmp_path: Path) -> None:
    with EventWriter(tmp_path, rank=2, role="drafter") as events:
        events.emit(
            "run_start", config="tiny-cpu", run_dir=str(tmp_path), pid=1, host="h", world_size=1, device="cpu"
        )
        events.phase("train")
        events.emit("step", **GOOD_STEP)
        events.emit("error", type="ValueError", message="boom", traceback_tail="...")
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        assert validate_line(line) == []
        obj = json.loads(line)
        assert (obj["v"], obj["rank"], obj["role"]) == (1, 2, "drafter")
    assert [e["event"] for e in read_events(tmp_path / "events.jsonl")] == [
        "run_start",
        "phase",
        "step",
        "error",
    ]


def test_missing_and_mistyped_fields_are_named() -> None:
    base = {"v": 1, "ts": 1.0, "event": "step", "rank": 0, "role": "single"}
    problems = validate_event({**base, **GOOD_STEP, "loss": "high", "acc": [0.1, "x"]})
    assert any(p.startswith("step.loss") for p in problems)
    assert any(p.startswith("step.acc") for p in problems)
    partial = dict(GOOD_STEP)
    del partial["grad_norm"]
    assert validate_event({**base, **partial}) == ["step.grad_norm: missing"]
    assert validate_event({**base, "role": "boss", **GOOD_STEP}) != []
    assert validate_event({**base, "rank": True, **GOOD_STEP}) != []  # a bool is not an int
    assert validate_event({**base, "event": "phase", "phase": "dancing"}) != []
    assert validate_event({**base, "v": 2, **GOOD_STEP}) != []
    assert validate_event([1, 2]) != []
    assert validate_line("{not json") != []
    evaluation = {
        **base,
        "event": "eval",
        "step": 1,
        "tau_mean": 1.5,
        "tau_hist": [1, 1],
        "tau_estimate": 1.4,
    }
    assert validate_event(evaluation) == []  # written before `set`: optional fields may be absent
    assert validate_event({**evaluation, "set": "general", "split": "general"}) == []
    assert validate_event({**evaluation, "set": 3}) == ["eval.set: expected str, got 3"]


def test_buckets_event_checks_each_bucket() -> None:
    base = {"v": 1, "ts": 1.0, "event": "buckets", "rank": 0, "role": "single"}
    good = {"batches_per_epoch": 3, "min": 1, "max": 2, "avg": 1.5}
    bucket = {"index": 0, "lo": 0, "hi": 8, "batches": 3, "percent": 100.0}
    assert validate_event({**base, **good, "buckets": [bucket]}) == []
    broken = {k: v for k, v in bucket.items() if k != "hi"}
    assert validate_event({**base, **good, "buckets": [broken]}) == ["buckets.buckets[0].hi: missing"]


def test_unknown_events_and_extra_fields_are_allowed_nan_but_not_inf() -> None:
    base = {"v": 1, "ts": 1.0, "rank": 0, "role": "single"}
    assert validate_event({**base, "event": "something_new", "x": 1}) == []
    assert validate_event({**base, "event": "step", **GOOD_STEP, "extra": "ok"}) == []
    assert validate_event({**base, "event": "step", **GOOD_STEP, "loss": math.nan}) == []
    assert validate_event({**base, "event": "step", **GOOD_STEP, "loss": math.inf}) != []


def test_every_event_of_the_table_has_a_schema() -> None:
    expected = {
        "run_start", "phase", "buckets", "load_progress", "progress", "step", "checkpoint",
        "eval", "compile_cache", "balance", "error", "done", "target", "resume", "serve_bench",
        "checkpoint_set_aside",
    }  # fmt: skip
    assert set(EVENT_FIELDS) == expected
    doc = (Path(__file__).resolve().parents[2] / "training" / "EVENTS.md").read_text()
    for event, fields in EVENT_FIELDS.items():
        assert f"`{event}`" in doc
        for name in fields:
            assert f"`{name}`" in doc, (event, name)


def test_the_eval_events_optional_fields_are_checked_where_present() -> None:
    base = {"v": 1, "ts": 1.0, "rank": 0, "role": "single", "event": "eval"}
    base |= {"step": 5, "tau_mean": 1.5, "tau_hist": [1, 1], "tau_estimate": 1.4}
    tree = {"budget": 16, "tau_mean": 1.8, "tau_prompt_mean": 1.7, "hist": [1, 4], "rounds": 5}
    tree |= {"tree_size_mean": 16.0}
    assert validate_event(base) == []  # an older trainer's event: no tree
    assert validate_event({**base, "tree": [tree, {**tree, "budget": 64}], "split": "train"}) == []
    assert validate_event({**base, "tree": [{**tree, "rounds": 2.5}]}) == [
        "eval.tree[0].rounds: expected int, got 2.5"
    ]
    missing = {k: v for k, v in tree.items() if k != "tree_size_mean"}
    assert validate_event({**base, "tree": [missing]}) == ["eval.tree[0].tree_size_mean: missing"]
    assert validate_event({**base, "tree": {"16": 1.8}}) == [
        "eval.tree: expected a list of tree budgets, got dict"
    ]
    assert validate_event({**base, "tau_prompt_mean": "high"}) != []
