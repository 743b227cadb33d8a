"""The lifecycle poll's own check can fail: ``statuspoll.violations`` flags a reading that names a
state the run was not in (read from a real run dir, its lock held by a real process) or an exit
code that does not go with its state, and passes a true one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import statuspoll
import testkit


def _event(ts: float, event: str, **fields: object) -> str:
    return json.dumps({"v": 1, "ts": ts, "event": event, "rank": 0, "role": "single", **fields})


def reading(state: str, code: int, run_id: str = "r1") -> dict[str, object]:
    return {"run_id": run_id, "state": state, "exit_code": code}


def test_a_live_relaunch_read_as_its_previous_launchs_end_is_a_violation(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = runs / "r1"
    run.mkdir(parents=True)
    (runs / "latest").symlink_to("r1")
    t0 = time.time() - 60
    launch1 = [_event(t0, "phase", phase="train"), _event(t0 + 1, "phase", phase="stopped")]
    (run / "events.jsonl").write_text("\n".join(launch1) + "\n")
    (run / "exit_code").write_text("0\n")
    stopped = statuspoll.truth(runs)
    assert statuspoll.allowed(stopped, 600) == {"stopped"}
    assert (
        statuspoll.violations([{"before": stopped, "reading": reading("stopped", 10), "after": stopped}], 600)
        == []
    )

    # The next launch: its wrapper holds the lock and wrote when it started; no phase of its own yet.
    (run / "exit_code").unlink()
    (run / "launched_at").write_text(f"{t0 + 10}\n")
    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run / "lock")])
    try:
        testkit.wait_for("the lock held", lambda: statuspoll.lock_held(run / "lock"), timeout=30)
        live = statuspoll.truth(runs)
        line = {"before": live, "after": live}
        assert statuspoll.violations([{**line, "reading": reading("starting", 0)}], 600) == []
        for lie in (reading("stopped", 10), reading("starting", 10), reading("starting", 0, "r0")):
            assert len(statuspoll.violations([{**line, "reading": lie}], 600)) == 1, lie
        # A phase reported between the two samples is a state the run was in.
        with (run / "events.jsonl").open("a") as fh:
            fh.write(_event(time.time(), "phase", phase="load_data") + "\n")
        later = statuspoll.truth(runs)
        assert (
            statuspoll.violations([{"before": live, "reading": reading("loading", 0), "after": later}], 600)
            == []
        )
        assert len(statuspoll.violations([{**line, "reading": reading("loading", 0)}], 600)) == 1
    finally:
        holder.kill()
        holder.wait()
