"""`fab status` in the long phases: progress, ETA, stall detection, honest figures, what a stop left."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleet.status.diagnose import killed_diagnosis
from fleet.status.model import RunFacts, build_status, eta_seconds, loss_trend
from fleet.status.render import render_text
from training.contract import validate_event

T0 = 1_764_460_000.0
REGEN = "regenerating the data (144 greedy replies)"


def ev(ts: float, event: str, **fields: Any) -> str:
    obj = {"v": 1, "ts": T0 + ts, "event": event, "rank": 0, "role": "single", **fields}
    assert validate_event(obj) == [], validate_event(obj)
    return json.dumps(obj)


def progress(
    ts: float, done: float, total: float = 1000.0, phase: str = "load_data", what: str = REGEN
) -> str:
    rate = done / ts if ts > 0 else 0.0
    return ev(
        ts, "progress", phase=phase, what=what, done=done, total=total, unit="tokens", rate=rate, seconds=ts
    )


def step(ts: float, n: int, loss: float = 3.0, epoch: int = 0, total: int = 100, **extra: Any) -> str:
    return ev(
        ts, "step", step=n, total_steps=total, epoch=epoch, loss=loss, acc=[0.5], tau=1.5, lr=1e-3,
        tokens_per_s=100.0, grad_norm=1.0, mem_gib=0.0, **extra,
    )  # fmt: skip


START = [
    ev(0, "run_start", config="smol-cpu", run_dir="/r", pid=1, host="h", world_size=1, device="cpu"),
    ev(0, "phase", phase="load_data"),
]


def status(events: list[str], now: float, **facts: Any):
    text = "\n".join(events) + "\n"
    return build_status("t", RunFacts(run_id="r1", alive=True, now=T0 + now, **facts), text, "")


def test_the_data_phase_shows_its_fraction_and_eta() -> None:
    st = status([*START, progress(10, 0), progress(20, 100), progress(30, 250)], now=31)
    assert st.state == "loading" and st.phase == "load_data"
    assert st.progress is not None and st.progress.fraction == pytest.approx(0.25)
    assert st.eta_s == pytest.approx((1000 - 250) / (250 / 30))  # the phase's own rate
    text = render_text(st, now=T0 + 31)
    assert "regenerating the data (144 greedy replies): 250/1,000 tokens (25%)" in text
    assert "ETA 90s" in text
    assert st.to_json()["progress"]["done"] == 250


def test_a_progressing_phase_is_never_stalled_however_long() -> None:
    """An hour of regeneration, a report every 10 s that moved: loading, not stalled."""
    events = [*START, *(progress(t, t / 4, total=100_000) for t in range(10, 3600, 10))]
    st = status(events, now=3601, log_mtime=T0)  # the log itself silent for an hour
    assert st.state == "loading" and not any("no progress" in n for n in st.notes)


def test_a_phase_whose_reports_stopped_moving_is_stalled_and_named() -> None:
    """The reporter thread still beats, the work does not move: stalled after the window."""
    events = [*START, progress(10, 100), *(progress(t, 100) for t in range(20, 800, 10))]
    st = status(events, now=800, log_mtime=T0 + 10, events_mtime=T0 + 790)
    assert st.state == "stalled"
    note = next(n for n in st.notes if "no progress" in n)
    assert "phase load_data: regenerating the data (144 greedy replies): 100/1,000 tokens (10%)" in note


def test_an_earlier_phases_progress_is_not_shown() -> None:
    events = [*START, progress(10, 1000), ev(11, "phase", phase="load_target")]
    st = status(events, now=12)
    assert st.phase == "load_target" and st.progress is None


def test_the_eval_shows_its_own_eta_not_the_training_one() -> None:
    events = [
        *START,
        ev(5, "phase", phase="train"),
        step(10, 1),
        step(20, 100),
        ev(21, "phase", phase="eval"),
    ]
    events.append(progress(41, 60, total=240, phase="eval", what="evaluating acceptance (6 prompts)"))
    st = status(events, now=42)
    assert st.state == "evaluating" and st.eta_s == pytest.approx(180 / (60 / 41))


def test_eta_prices_the_cached_epochs_without_the_target() -> None:
    """Epoch 0 runs the target (90% of a 10 s step); the later epochs read its cached states."""
    steps = [step(10 * n, n, step_s=10.0, target_s=9.0) for n in range(1, 11)]
    got = eta_seconds([json.loads(s) for s in steps], batches_per_epoch=20)
    # 10 steps left in epoch 0 at 10 s, then 80 at 10 s x (1 - 0.9)
    assert got == pytest.approx(10 * 10 + 80 * 1.0)
    later = [step(100 + n, 20 + n, epoch=1, step_s=1.0, target_s=0.0) for n in range(1, 6)]
    assert eta_seconds([json.loads(s) for s in [*steps, *later]], 20) == pytest.approx(75 * 1.0)


def test_eta_without_the_cache_is_the_recent_pace() -> None:
    steps = [json.loads(step(2 * n, n)) for n in range(1, 11)]
    assert eta_seconds(steps, batches_per_epoch=20) == pytest.approx(90 * 2.0)


def test_the_recent_loss_change_is_recent_and_says_its_window() -> None:
    """The smol run's shape: 69 at step 1, flat near 6 after: no -58%."""
    points = [(1, 69.0), *((n, 6.0 + (0.1 if n % 20 else -0.1)) for n in range(10, 170, 10))]
    change, window = loss_trend(points)
    assert window == 50 and abs(change) < 0.02
    falling = [(n, 10.0 - n / 20) for n in range(10, 210, 10)]
    change, window = loss_trend(falling)  # last 50 steps (160-200) vs the 50 before (110-150)
    recent, before = 10 - 180 / 20, 10 - 130 / 20  # the windows' means
    assert change == pytest.approx((recent - before) / before)
    assert loss_trend([(1, 9.0), (10, 8.0), (20, 7.0)]) is None  # too few to say


def test_render_says_which_window() -> None:
    events = [*START, ev(5, "phase", phase="train"), *(step(10 + n, n, loss=6.0) for n in range(10, 170, 10))]
    text = render_text(status(events, now=200), now=T0 + 200)
    assert "over the last 50 steps vs the 50 before" in text


def test_a_stop_in_the_data_phase_says_a_resume_starts_over() -> None:
    events = [*START, progress(10, 100), ev(12, "phase", phase="stopped", during="load_data", resume_step=0)]
    st = build_status(
        "t", RunFacts(run_id="r1", alive=False, exit_code=0, now=T0 + 20), "\n".join(events), ""
    )
    assert st.state == "stopped" and st.progress is None
    assert (
        "stopped during load_data: `fab train` starts the run again from step 1 (it wrote no checkpoint)"
        in (st.notes)
    )


def test_a_forced_kill_tells_what_a_resume_will_find() -> None:
    none = killed_diagnosis(137, "KILL", None, (), checkpoint_step=None)
    some = killed_diagnosis(137, "KILL", None, (), checkpoint_step=40)
    assert none is not None and some is not None
    assert "starts the run again from step 1" in none.fix and "last checkpoint" not in none.fix
    assert "resumes from the checkpoint of step 40" in some.fix
    other = killed_diagnosis(137, "", True, (), checkpoint_step=None)
    assert other is not None and "starts the run again from step 1" in other.fix


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_ends_a_watch_quietly(as_json: bool) -> None:
    """`fab status --watch` exits 0 on Ctrl-C, as `fab logs --follow` does: watch returns None."""
    from fleet.status.render import watch

    first = status([*START, progress(10, 100)], now=11)
    calls = iter([first])

    def get():
        try:
            return next(calls)
        except StopIteration:
            raise KeyboardInterrupt from None

    assert watch(get, 0.2, as_json=as_json) is None
