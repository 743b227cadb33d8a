"""`fab status` end to end on the real test host (SSH -> pct shim -> LXC), run = training.selftest.

No timed assertions: every wait is a generous poll for a state, never a speed check.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from testkit import RemoteFleet

pytestmark = pytest.mark.hosts


def status_json(fleet: RemoteFleet) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    result = fleet.fab("status", "--json", timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip(), f"no JSON (rc {result.returncode}): {result.stderr}"
    return json.loads(result.stdout), result


def poll(fleet: RemoteFleet, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120):
    """Poll `fab status --json` until ``done``; returns every state seen and the last answer."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        data, result = status_json(fleet)
        if not seen or seen[-1] != data["state"]:
            seen.append(data["state"])
        if done(data):
            return seen, data, result
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}; states seen: {seen}, last: {data}")
        time.sleep(0.3)


def ended(data: dict[str, Any]) -> bool:
    """Finished, and the process gone with its exit status recorded."""
    return data["state"] == "finished" and data["process_exit_code"] is not None


def start(fleet: RemoteFleet, *overrides: str) -> None:
    fleet.write(
        run={"module": "training.selftest", "config": "selftest", "overrides": list(overrides), "env": {}}
    )
    for args in (("deploy",), ("train",)):
        result = fleet.fab(*args)
        assert result.returncode == 0, f"fab {args[0]}: {result.stderr}"


def test_status_moves_through_phases_to_finished(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    start(remote_fleet, "--selftest.steps=25", "--selftest.step_seconds=0.3")
    # "finished" comes with the done event; the exit status once the wrapper has written it after
    seen, data, result = poll(remote_fleet, ended, "finished with an exit status")
    assert result.returncode == 0
    assert "training" in seen and seen[-1] == "finished"
    assert seen.index("training") < seen.index("finished")
    assert data["phase"] == "done" and data["step"] == 25 and data["process_exit_code"] == 0
    assert data["loss"] is not None and data["tokens_per_s"] and data["diagnosis"] == []
    assert data["buckets"]["batches_per_epoch"] > 0
    assert data["last_checkpoint"] is not None
    text = remote_fleet.fab("status", timeout=60)
    assert text.returncode == 0 and "finished" in text.stdout and "25/25" in text.stdout
    # fab plot: the events fetched from the target, drawn locally
    png = tmp_path / "run.png"
    plotted = remote_fleet.fab("plot", "--out", str(png), timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_kill_9_gives_failed_with_exit_status(remote_fleet: RemoteFleet) -> None:
    start(remote_fleet, "--selftest.steps=100000", "--selftest.step_seconds=0.2")
    _, data, _ = poll(remote_fleet, lambda d: d["state"] == "training" and d["step"], "training")
    run_dir = f"{remote_fleet.workdir}/runs/{data['run_id']}"
    first = remote_fleet.hosts.pct_exec("head", "-n", "1", "--", f"{run_dir}/events.jsonl").stdout
    pid = json.loads(first)["pid"]
    remote_fleet.hosts.pct_exec("kill", "-9", str(pid))
    _, data, result = poll(remote_fleet, lambda d: d["state"] == "failed", "failed after kill -9")
    assert data["process_exit_code"] == 137 and data["alive"] is False
    assert result.returncode == 12


def test_log_that_stops_moving_is_stalled(remote_fleet: RemoteFleet) -> None:
    remote_fleet.write(stall_window_s=2)
    start(remote_fleet, "--selftest.steps=3", "--selftest.step_seconds=600")
    _, data, result = poll(remote_fleet, lambda d: d["state"] == "stalled", "stalled")
    assert result.returncode == 11 and data["alive"] is True
    assert any("no progress, new event or log output" in note for note in data["notes"])


def test_all_targets_one_row_each(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    start(remote_fleet, "--selftest.steps=5", "--selftest.step_seconds=0.2")
    poll(remote_fleet, lambda d: d["state"] == "finished", "finished")
    second = dict(remote_fleet.target, workdir=remote_fleet.workdir)
    empty = dict(remote_fleet.target, workdir="/nonexistent-fleet-workdir")
    down = dict(remote_fleet.target, container={"type": "pct", "id": remote_fleet.hosts.stopped_ct_id})
    from testkit import fab, render_inventory

    config = tmp_path / "all.toml"
    targets = {"a": remote_fleet.target, "b": second, "c": empty, "d": down}
    config.write_text(render_inventory(targets, "a"))
    result = fab("status", "--json", config=config, env={"FLEET_TARGET": "all"}, timeout=90)
    assert "Traceback" not in result.stderr, result.stderr
    rows = json.loads(result.stdout)
    assert [r["target"] for r in rows] == ["a", "b", "c", "d"]
    assert rows[0]["state"] == rows[1]["state"] == "finished"
    assert rows[2]["state"] == "never"  # no run there: a state like any other
    assert "status: stopped" in rows[3]["error"]
    assert result.returncode == 3  # the worst: d's container is down (TargetError)
