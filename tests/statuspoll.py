"""A run's status read as fast as it answers, each reading beside the truth of that instant.

Run as a second process beside a scenario that drives a run through its lifecycle::

    python tests/statuspoll.py FLEET_TOML RUNS_DIR OUT

It opens the inventory's default target once and, until SIGTERM, reads what ``fab status --json``
prints (``fetch_status(...).to_json()``: the task's own call, without a Python start-up per read).
While the scenario has a transition under way (:meth:`Watch.closely`: a stop, a relaunch's start-up,
a kill and the restart policy's back-off, a run's end) it reads at most every ``INTERVAL_S``, as
fast as it answers; between them, where the run only trains, every ``IDLE_INTERVAL_S``. A reading
costs ~0.35 s of CPU (the SSH channel, the container's pct and lxc-attach, the fetch script, the
parse): read as fast as it answers throughout, the poller took ~0.65 of a 2-core machine's CPUs
from the runs it watches, whose stops and kills must land inside their windows, and from the
suite's other worker. Around each reading it samples the truth from
the run dir itself (``RUNS_DIR``: the target's ``runs`` as this machine sees it; for a container,
its rootfs path), written here apart from fleet's code: whether a process of the run lives (its
lock is held: ``flock``), which launch (``launched_at``, ``segments.jsonl``), the phase that launch
reported last (its events since it started), a retry the wrapper recorded, the exit status. Each
line of OUT is ``{"before", "reading", "after"}``; :func:`violations` says which readings name a
state the run was in at neither sample nor in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
INTERVAL_S = 0.2  # inside a transition (Watch.closely)
IDLE_INTERVAL_S = 2.0  # between transitions: a run that only trains still has its readings checked
TICK_S = 0.1  # how soon a transition's window is noticed
ENDED = ("finished", "stopped", "failed")
EXIT_CODES = {"stopped": 10, "stalled": 11, "failed": 12}
# The phase words of training/EVENTS.md and the state each one means while the run lives.
LIVE_PHASES = {
    "load_data": "loading",
    "buckets": "loading",
    "load_target": "loading",
    "load_drafter": "loading",
    "compile": "compiling",
    "train": "training",
    "eval": "evaluating",
    "checkpoint": "checkpointing",
}
FINAL_PHASES = ("done", "stopped", "error")


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def lock_held(path: Path) -> bool:
    """A process of the run holds its lock (the wrapper takes it exclusively; its children inherit it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a shared lock taken here
    return False


def _events(path: Path) -> list[dict[str, Any]]:
    found = []
    for line in _text(path).splitlines():
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if isinstance(ev, dict) and isinstance(ev.get("ts"), int | float):
                found.append(ev)
    return found


def phases(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """(ts, phase) each time the phase changed (a step means ``train`` unless the phase is final)."""
    seen: list[tuple[float, str]] = []
    for ev in events:
        phase = ev.get("phase") if ev.get("event") == "phase" else None
        if ev.get("event") == "step" and (not seen or seen[-1][1] not in ("train", *FINAL_PHASES)):
            phase = "train"
        if isinstance(phase, str) and (not seen or seen[-1][1] != phase):
            seen.append((float(ev["ts"]), phase))
    return seen


def truth(runs: Path) -> dict[str, Any]:
    """What is true of the latest run at this instant, from its files."""
    at = time.time()
    try:
        run_id = os.readlink(runs / "latest").rsplit("/", 1)[-1]
    except OSError:
        run_id = ""
    t: dict[str, Any] = {"at": at, "run_id": run_id}
    if not run_id:
        return t
    d = runs / run_id
    alive = lock_held(d / "lock")  # first: every file read after it is at least as new
    launched_at = _number(_text(d / "launched_at"))
    attempts = [json.loads(x) for x in _text(d / "attempts.jsonl").splitlines() if x.strip()]
    last = attempts[-1] if attempts else {}
    events = _events(d / "events.jsonl")
    launch = [e for e in events if alive and launched_at is not None and e["ts"] >= launched_at]
    mtimes = [p.stat().st_mtime for p in (d / "events.jsonl", d / "train.log") if p.exists()]
    t.update(
        alive=alive,
        launched_at=launched_at,
        launches=len(_text(d / "segments.jsonl").splitlines()),
        exit_code=_number(_text(d / "exit_code")),
        retry_pending=bool(
            alive and last.get("retry") is True and (launched_at is None or last.get("ts", 0) >= launched_at)
        ),
        launch_phases=phases(launch) if alive else [],
        last_phase=(phases(events) or [(0.0, "")])[-1][1],
        activity=max([*mtimes, launched_at or 0.0]),
    )
    return t


def live_state(launch_phases: Sequence[tuple[float, str]]) -> str:
    """The state of a live launch: its last live phase (a final one is still exiting), else starting."""
    live = [p for _, p in launch_phases if p not in FINAL_PHASES]
    return LIVE_PHASES.get(live[-1], "starting") if live else "starting"


def allowed(t: Mapping[str, Any], stall_s: float) -> set[str]:
    """The states a reading may name when ``t`` is true."""
    if not t.get("run_id"):
        return {"never"}
    if not t["alive"]:
        code, last = t["exit_code"], t["last_phase"]
        if code == 0:
            return {"finished" if last == "done" else "stopped"}
        if code is not None:
            return {"failed"}
        return {{"done": "finished", "stopped": "stopped"}.get(last, "failed")}
    if t["retry_pending"]:
        return {"restarted"}
    states = {live_state(t["launch_phases"])}
    if t["at"] - t["activity"] > stall_s - 1.0:
        states.add("stalled")
    return states


def violations(lines: Sequence[Mapping[str, Any]], stall_s: float) -> list[str]:
    """The readings that name a state the run was in neither before nor after nor in between, or
    an exit code that does not agree with their state."""
    bad = []
    for line in lines:
        before, reading, after = line["before"], line["reading"], line["after"]
        ok = allowed(before, stall_s) | allowed(after, stall_s)
        if after.get("alive") and after.get("run_id") == before.get("run_id"):
            # the phases this launch went through while the reading was made
            went = [(ts, p) for ts, p in after["launch_phases"] if before["at"] <= ts <= after["at"]]
            ok |= {live_state([*before.get("launch_phases", []), *went[: i + 1]]) for i in range(len(went))}
        state = reading["state"]
        why = []
        if state not in ok:
            why.append(f"state {state}, true: {sorted(ok)}")
        if reading["exit_code"] != EXIT_CODES.get(state, 0):
            why.append(f"exit code {reading['exit_code']} for {state}")
        if reading.get("run_id", "") not in (before.get("run_id"), after.get("run_id")):
            why.append(f"run {reading.get('run_id')}, true: {before.get('run_id')} / {after.get('run_id')}")
        if why:
            bad.append(f"{'; '.join(why)} | reading {json.dumps(reading)} | before {json.dumps(before)}")
    return bad


def read_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in _text(out).splitlines() if x.strip()]


def closely_flag(out: Path) -> Path:
    """The file that asks the poller to read as fast as it answers while it exists."""
    return out.with_name(out.name + ".closely")


@dataclass(frozen=True)
class Watch:
    """The running poller: OUT, and the windows in which it reads as fast as it answers."""

    out: Path

    @contextlib.contextmanager
    def closely(self) -> Iterator[None]:
        """Read as fast as it answers for the ``with`` block (a transition under way, up to the
        state it leads to): the poller takes its next reading at once."""
        flag = closely_flag(self.out)
        flag.touch()
        try:
            yield
        finally:
            flag.unlink(missing_ok=True)


@contextlib.contextmanager
def polling(config: Path, runs: Path, out: Path) -> Iterator[Watch]:
    """This module as a second process for the ``with`` block."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.Popen([sys.executable, __file__, str(config), str(runs), str(out)], env=env)
    try:
        yield Watch(out)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        closely_flag(out).unlink(missing_ok=True)


def _wait_for_next(started: float, flag: Path, stopping: list[int]) -> None:
    """Sleep until the next reading is due: INTERVAL_S after ``started`` inside a window (the flag
    exists), IDLE_INTERVAL_S outside one; a window opened meanwhile makes it due at once."""
    while not stopping:
        interval = INTERVAL_S if flag.exists() else IDLE_INTERVAL_S
        left = interval - (time.monotonic() - started)
        if left <= 0:
            return
        time.sleep(min(TICK_S, left))


def main(argv: list[str]) -> int:
    config, runs, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    from fleet.inventory import load_inventory, select_targets
    from fleet.status.fetch import fetch_status
    from fleet.target import open_target

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    spec = select_targets(load_inventory(config), allow_all=False)[0]
    target = open_target(spec)
    flag = closely_flag(out)
    with out.open("a") as fh:
        while not stopping:
            started = time.monotonic()
            before = truth(runs)
            st = fetch_status(target).to_json()
            after = truth(runs)
            keys = ("run_id", "state", "phase", "exit_code", "alive", "step", "attempt")
            reading = {k: st.get(k) for k in keys}
            fh.write(json.dumps({"before": before, "reading": reading, "after": after}) + "\n")
            fh.flush()
            _wait_for_next(started, flag, stopping)
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
