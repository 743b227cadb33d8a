"""The suite's own checks can fail: ``phase_progress_gaps`` (what the status-polling tests assert)
flags a long phase shown without its fraction or ETA, and passes one that shows both."""

from __future__ import annotations

from testkit import phase_progress_gaps

T0 = 1_000.0


def snapshot(state: str, age: float, **fields: object) -> dict[str, object]:
    base = {"state": state, "phase": state, "since": T0, "polled_at": T0 + age, "progress": None}
    base.update({"step": None, "total_steps": None, "eta_s": None})
    return {**base, **fields}


def test_a_phase_with_its_fraction_and_eta_passes() -> None:
    progress = {"done": 48, "total": 144, "unit": "replies"}
    seen = [
        snapshot("loading", 3.0),  # not yet settled: its first report may still be coming
        snapshot("loading", 30.0, progress=progress, eta_s=60.0),
        snapshot("training", 40.0, step=5, total_steps=150, eta_s=300.0),
    ]
    assert phase_progress_gaps(seen) == []


def test_a_bare_long_phase_or_a_step_without_eta_is_a_gap() -> None:
    seen = [
        snapshot("loading", 30.0),
        snapshot("evaluating", 30.0, progress={"done": 3, "total": 16}),
        snapshot("training", 30.0),
        snapshot("training", 30.0, step=5, total_steps=150),
    ]
    gaps = phase_progress_gaps(seen)
    assert [g.split(":")[1].strip() for g in gaps] == [
        "no fraction (None)",
        "no ETA ({'done'",
        "neither a step nor progress",
        "step 5 without total or ETA",
    ]
