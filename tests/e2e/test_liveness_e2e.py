"""A run is never lost, through the real `fab` on the real test host (SSH -> pct shim -> LXC
container 200, whose /bin/sh is dash): liveness from the run's own lock whatever happens to tmux,
a launch that is whole or nothing, the env build a live run started with, and the notifier's
secrets.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import testkit

if TYPE_CHECKING:
    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts
wait_for = functools.partial(testkit.wait_for, interval=0.3)

LONG_RUN = ["--selftest.steps=100000", "--selftest.step_seconds=0.2"]
SHORT_RUN = ["--selftest.steps=6", "--selftest.step_seconds=0.05"]
FINAL = ("finished", "stopped", "failed")


def ct_read(hosts: TestHost, path: str) -> str | None:
    result = hosts.pct_exec("cat", "--", path, check=False)
    return result.stdout if result.returncode == 0 else None


def ct_ls(hosts: TestHost, path: str) -> list[str]:
    result = hosts.pct_exec("ls", "-A", "--", path, check=False)
    return result.stdout.split() if result.returncode == 0 else []


def status_json(fleet: RemoteFleet) -> dict[str, Any]:
    result = fleet.fab("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def one_line_error(result: Any) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    return lines[0]


def selftest(
    fleet: RemoteFleet, overrides: list[str], env: dict[str, str] | None = None, **more: Any
) -> None:
    run = {"module": "training.selftest", "config": "selftest", "overrides": overrides, "env": env or {}}
    fleet.write(run=run, **more)


def trainer_cmdlines(run_dir: str) -> list[list[bytes]]:
    """Command lines (host view) of the selftest processes of ``run_dir``."""
    return [argv for _, argv in trainers(run_dir)]


def trainers(run_dir: str) -> list[tuple[int, list[bytes]]]:
    """(pid, command line), host view, of the selftest processes of ``run_dir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_python = b"python" in argv[0].rsplit(b"/", 1)[-1]
        if is_python and b"training.selftest" in argv and any(run_dir.encode() in a for a in argv):
            found.append((int(proc.name), argv))
    return found


def latest(fleet: RemoteFleet) -> str:
    return fleet.hosts.pct_exec("readlink", "--", f"{fleet.workdir}/runs/latest").stdout.strip()


def test_a_run_outlives_tmux_and_is_still_live_for_status_runs_train_stop_and_pruning(
    remote_fleet: RemoteFleet,
) -> None:
    """`tmux kill-server` in the container: the trainer trains on. status says training, runs says
    live, `fab train` and `fab train --fresh` (keep_runs = 1) refuse and delete nothing, and `fab
    stop` reaches the process group without tmux."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    selftest(fleet, LONG_RUN, keep_runs=1)
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    run_id = latest(fleet)
    run_dir = f"{fleet.workdir}/runs/{run_id}"
    wait_for("the trainer", lambda: bool(trainer_cmdlines(run_dir)))
    hosts.pct_exec(fleet.target["commands"]["tmux"], "kill-server", check=False)
    wait_for(
        "tmux to be gone",
        lambda: hosts.pct_exec(fleet.target["commands"]["tmux"], "ls", check=False).returncode != 0,
    )
    assert trainer_cmdlines(run_dir), "the trainer died with tmux"

    st = status_json(fleet)
    assert (st["run_id"], st["state"]) == (run_id, "training"), st
    runs = fleet.fab("runs", "--json")
    assert runs.returncode == 0, runs.stderr
    assert [r["state"] for r in json.loads(runs.stdout)] == ["live"], runs.stdout

    again = fleet.fab("train", "--no-warm")
    assert again.returncode == 5 and run_id in one_line_error(again), again.stdout + again.stderr
    fresh = fleet.fab("train", "--no-warm", "--fresh")
    assert fresh.returncode == 5, fresh.stdout + fresh.stderr
    assert ct_ls(hosts, f"{fleet.workdir}/runs") == sorted(["latest", run_id]), (
        "a second run or a deleted one"
    )
    assert len(trainer_cmdlines(run_dir)) == 1, "a second trainer in the run dir"

    stop = fleet.fab("stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "nothing was stopped" not in stop.stdout, stop.stdout
    wait_for("the trainer to end", lambda: not trainer_cmdlines(run_dir))
    assert status_json(fleet)["state"] == "stopped"
    assert run_id in ct_ls(hosts, f"{fleet.workdir}/runs")


CUTTING_PCT = """#!{python}
# The real pct, except that the run launcher's stdin is cut short: a connection that dropped while
# the run's environment travelled.
import subprocess, sys
real = {real!r}
if "fleet-run-launch" in sys.argv:
    data = sys.stdin.buffer.read()
    sys.exit(subprocess.run([real, *sys.argv[1:]], input=data[: len(data) // 2]).returncode)
import os
os.execv(real, [real, *sys.argv[1:]])
"""


def test_a_launch_whose_environment_arrives_short_starts_nothing_and_a_retry_starts_it_whole(
    remote_fleet: RemoteFleet, tmp_path: Path
) -> None:
    fleet, hosts = remote_fleet, remote_fleet.hosts
    secret = uuid.uuid4().hex
    selftest(fleet, LONG_RUN, {"FLEET_TEST_SECRET": secret, "FLEET_TEST_OTHER": "x" * 200})
    assert fleet.fab("deploy").returncode == 0
    cutting = tmp_path / "cutting-pct"
    cutting.write_text(CUTTING_PCT.format(python=sys.executable, real=hosts.pct))
    cutting.chmod(0o755)
    fleet.write(commands={**fleet.defaults["commands"], "pct": str(cutting)})
    cut = fleet.fab("train", "--no-warm")
    assert cut.returncode == 5, cut.stdout + cut.stderr
    line = one_line_error(cut)
    assert "arrived incomplete" in line and secret not in line, line
    assert [n for n in ct_ls(hosts, f"{fleet.workdir}/runs") if not n.startswith(".")] == [], "a run was left"
    assert status_json(fleet)["state"] == "never"

    fleet.write(commands=fleet.defaults["commands"])
    whole = fleet.fab("train", "--no-warm")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    run_dir = f"{fleet.workdir}/runs/{latest(fleet)}"
    wait_for("the trainer", lambda: bool(trainer_cmdlines(run_dir)))
    ((pid, _),) = trainers(run_dir)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"FLEET_TEST_SECRET={secret}".encode() in environ, "the trainer lacks the run's environment"


def test_an_env_switch_under_a_live_run_does_not_change_its_interpreter(remote_fleet: RemoteFleet) -> None:
    """The run's interpreter given as envs/<env>/current/bin/python3 is pinned to the build
    `current` named at launch (recorded in run.json); repointing `current` (what env-rebuild,
    env-rollback and a deploy with another lock do) leaves the live run on its build, and the
    next launch takes the new one."""
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    for build in ("selftest-aaaaaaaaaaaa", "selftest-bbbbbbbbbbbb"):
        hosts.pct_exec("mkdir", "-p", f"{workdir}/envs/{build}/bin")
        hosts.pct_exec("ln", "-s", "/usr/bin/python3", f"{workdir}/envs/{build}/bin/python3")
    hosts.pct_exec("mkdir", "-p", f"{workdir}/envs/selftest")
    hosts.pct_exec("ln", "-sfn", "../selftest-aaaaaaaaaaaa", f"{workdir}/envs/selftest/current")
    selftest(fleet, LONG_RUN)
    fleet.write(
        commands={**fleet.defaults["commands"], "python": f"{workdir}/envs/selftest/current/bin/python3"}
    )
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    run_dir = f"{workdir}/runs/{latest(fleet)}"
    wait_for("the trainer", lambda: bool(trainer_cmdlines(run_dir)))
    hosts.pct_exec("ln", "-sfn", "../selftest-bbbbbbbbbbbb", f"{workdir}/envs/selftest/current")
    (argv,) = trainer_cmdlines(run_dir)
    assert argv[0] == f"{workdir}/envs/selftest-aaaaaaaaaaaa/bin/python3".encode(), argv
    record = json.loads(ct_read(hosts, f"{run_dir}/run.json") or "{}")
    assert record.get("env_dir") == f"{workdir}/envs/selftest-aaaaaaaaaaaa", record


@pytest.mark.parametrize(
    ("notify", "key"),
    [
        ({"url": "https://hooks.example/t0ken\x01x"}, "notify.url"),
        (
            {"url": "https://hooks.example/hook", "headers": {"Authorization": "Bearer t0ken\u2603"}},
            "notify.headers.Authorization",
        ),
    ],
    ids=["url-control-char", "header-not-latin1"],
)
def test_a_notifier_url_or_header_that_cannot_be_sent_is_refused_in_the_inventory(
    remote_fleet: RemoteFleet, notify: dict[str, Any], key: str
) -> None:
    remote_fleet.write(notify=notify)
    result = remote_fleet.fab("status")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert key in line and "t0ken" not in line, line


def test_the_notify_command_gets_no_run_secret_unless_named_and_never_holds_the_run(
    remote_fleet: RemoteFleet,
) -> None:
    """The notify command sees PATH and the run.env keys named in notify.command_env only; a
    command that hangs holds neither the exit status nor the run's liveness."""
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    secret, shared = uuid.uuid4().hex, uuid.uuid4().hex
    dump = f"{workdir}/notify-env"
    command = ["sh", "-c", f"env > {dump}.tmp && mv {dump}.tmp {dump}; sleep 600"]
    selftest(
        fleet,
        SHORT_RUN,
        {"FLEET_TEST_SECRET": secret, "PAGER_TOKEN": shared},
        notify={"command": command, "command_env": ["PAGER_TOKEN"]},
    )
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    testkit.wait_status(
        fleet,
        lambda: status_json(fleet),
        lambda st: st["state"] == "finished",
        "the run to finish",
        timeout=60,
    )
    wait_for("the notify command", lambda: ct_read(hosts, dump) is not None, timeout=60)
    env = ct_read(hosts, dump) or ""
    assert f"PAGER_TOKEN={shared}" in env, env
    assert secret not in env and "FLEET_NOTIFY" not in env, env
    assert re.search(r"^PATH=", env, re.M), env


def sshd_sessions(master_pidfile: str) -> list[int]:
    """The test host's sshd session processes (children of its listening sshd)."""
    master = Path(master_pidfile).read_text().strip()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == master:
                found.append(int(proc.name))
    return found


@pytest.mark.exclusive_host  # it drops every session of the shared sshd: the other tests' too
def test_status_watch_rides_out_a_dropped_ssh_session(remote_fleet: RemoteFleet) -> None:
    fleet, hosts = remote_fleet, remote_fleet.hosts
    selftest(fleet, ["--selftest.steps=40", "--selftest.step_seconds=0.2"])
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_CONFIG=str(fleet.config), PYTHONUNBUFFERED="1")
    watch = subprocess.Popen(
        [str(testkit.FAB), "status", "--watch", "0.5", "--json"],
        cwd=testkit.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())
        assert first["state"] not in FINAL, first
        for pid in sshd_sessions(hosts.sshd_pidfile):  # the network drops every session
            os.kill(pid, signal.SIGKILL)
        out, err = watch.communicate(timeout=120)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert "Traceback" not in err, err
    assert watch.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["state"] == "finished", out
