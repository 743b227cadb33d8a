"""fleet.runs: pure helpers, and real runs of training.selftest in real tmux on the local target.

tmux runs on a private server (the `local_tmux` fixture sets TMUX_TMPDIR), never the user's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import pytest
from testkit import argv_of, ctrl_c_reaches_it, descendants, framed, kill_processes_naming, wait_for

import training
from fleet import deploy as d
from fleet import remote, runs
from fleet.errors import FleetError, RunError
from fleet.inventory import Commands, NotifySpec, RunSpec, TargetSpec
from fleet.layout import RUN_SESSION
from fleet.target import LocalTarget, open_target
from training.events import read_events, validate_event

if TYPE_CHECKING:
    from testkit import LocalTmux, RemoteFleet

REPO = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 11, 30, 1, 2, 3, tzinfo=dt.UTC)
SECRET = "s3cr3t-'quoted' $(touch /tmp/fleet-pwned) `id` ;x"


# ------------------------------------------------------------------ pure parts


def test_run_id_format_and_bump() -> None:
    assert runs.make_run_id(T0, "tiny-cpu") == "20261130T010203Z-tiny-cpu"
    assert runs.make_run_id(T0, "configs/My Run.toml") == "20261130T010203Z-My-Run"
    assert runs.make_run_id(T0, "tiny-cpu", "20261130T010203Z-tiny-cpu") == "20261130T010204Z-tiny-cpu"
    assert runs.make_run_id(T0, "x", "garbage") == "20261130T010203Z-x"


def test_env_file_round_trips_through_a_real_shell(tmp_path: Path) -> None:
    env_file = tmp_path / "run.env"
    env_file.write_bytes(runs.env_file_text({"B_KEY": SECRET, "A_KEY": "plain", "EMPTY": ""}))
    out = subprocess.run(
        ["bash", "-c", '. "$1"; printf "%s\\0" "$A_KEY" "$B_KEY" "$EMPTY"', "sh", str(env_file)],
        capture_output=True,
        check=True,
    ).stdout
    assert out.split(b"\0")[:3] == [b"plain", SECRET.encode(), b""]
    assert not Path("/tmp/fleet-pwned").exists()
    with pytest.raises(RunError):
        runs.env_file_text({"BAD-KEY": "x"})


# Recorded from run_state.sh against a live run (tmux 3.3a prints empty dead-status fields).
RUN_JSON = (
    '{"run_id": "20261130T000002Z-tiny-cpu", "release": "20261130T000001Z-abcdef1", "started_at": "t0"}'
)


def state_text(pane: str = "0 4242  ", exit_code: tuple[int, str] = (1, "cat: exit_code: missing")) -> str:
    return framed(
        ("pane", 0 if pane else 1, pane or "no server running on /tmp/tmux-0/default"),
        ("current", 0, "releases/20261130T000001Z-abcdef1"),
        ("latest", 0, "20261130T000002Z-tiny-cpu"),
        ("run_json", 0, RUN_JSON),
        ("exit_code", *exit_code),
        ("pgid", 0, "4242"),
        ("alive", 0, "0"),
        ("log", 0, "step 1/10\n@@fleet log 0 1\n@@not-a-section"),
    )


def test_parse_state_live_exited_never() -> None:
    live = runs.parse_state("t", state_text())
    assert live.state == "live" and live.exit_code is None
    assert live.run_id == "20261130T000002Z-tiny-cpu" and live.release_id == "20261130T000001Z-abcdef1"
    assert live.current_release == "20261130T000001Z-abcdef1"
    log = ("step 1/10", "@@fleet log 0 1", "@@not-a-section")
    assert live.last_lines == log  # the log's lines stay text whatever they look like
    exited = runs.parse_state("t", state_text("1 4242 3 ", (0, "7")))
    assert exited.state == "exited" and exited.exit_code == 7  # run.sh's record wins
    from_tmux = runs.parse_state("t", state_text("1 4242 3 "))
    assert from_tmux.state == "exited" and from_tmux.exit_code == 3
    signalled = runs.parse_state("t", state_text("1 4242  9"))
    assert signalled.exit_code == 137
    gone = runs.parse_state("t", state_text(""))  # tmux server gone (reboot)
    assert gone.state == "exited" and gone.exit_code is None and "unknown" in gone.text()
    missing = ((name, 1, "") for name in ("pane", "current", "run_json"))
    never = runs.parse_state("t", framed(*missing, ("latest", 0, "")))
    assert never.state == "never" and never.run_id is None
    assert json.loads(live.to_json())["last_lines"] == list(log)


# Recorded from run_state.sh after a selftest run failed at step 3 (tmux 3.3a). Note the pane line
# "1 10364  ": dead, but tmux left the status empty (it had not reaped the process), which is why
# run.sh records its own exit_code.
RECORDED_EXITED = framed(
    ("pane", 0, "1 10364  "),
    ("current", 0, "releases/20261130T003216Z-0000000-dirty"),
    ("latest", 0, "20261130T003216Z-selftest"),
    (
        "run_json",
        0,
        '{"run_id": "20261130T003216Z-selftest", "release": "20261130T003216Z-0000000-dirty", '
        '"release_dir": "/tmp/fr/w/releases/20261130T003216Z-0000000-dirty", '
        '"run_dir": "/tmp/fr/w/runs/20261130T003216Z-selftest", "argv": ["/work/main/.venv/bin/python", '
        '"-m", "training.selftest", "train", "--config", "selftest", "--run-dir", '
        '"/tmp/fr/w/runs/20261130T003216Z-selftest", "--selftest.steps=3", "--selftest.step_seconds=0.1", '
        '"--selftest.fail_at=3"], "started_at": "2026-11-30T00:32:16+00:00", "target": "t", '
        '"module": "training.selftest", "config": "selftest", "env_keys": [], "tmux_session": "fleet-run"}',
    ),
    ("exit_code", 0, "1"),
    ("pgid", 0, "10364"),
    (
        "log",
        0,
        "step 1/3 loss=7.7387 acc1=0.154\nstep 2/3 loss=7.0498 acc1=0.280\n"
        "RuntimeError: selftest failure injected at step 3\nfleet: run exited with code 1",
    ),
)


def test_parse_state_recorded_exited_run() -> None:
    status = runs.parse_state("t", RECORDED_EXITED)
    assert status.state == "exited" and status.exit_code == 1 and status.foreign_pid is None
    assert status.run_id == "20261130T003216Z-selftest"
    assert status.release_id == status.current_release == "20261130T003216Z-0000000-dirty"
    assert status.started_at == "2026-11-30T00:32:16+00:00"
    assert status.last_lines[-1] == "fleet: run exited with code 1" and len(status.last_lines) == 4
    assert status.text().splitlines()[0] == (
        "t: run 20261130T003216Z-selftest exited with code 1 (release 20261130T003216Z-0000000-dirty)"
    )


# ------------------------------------------------------------------ real runs (local target, real tmux)


def events_of(run_dir: str) -> list[dict[str, object]]:
    path = Path(run_dir) / "events.jsonl"
    return read_events(path) if path.exists() else []


def has_step(run_dir: str) -> bool:
    return any(e["event"] == "step" for e in events_of(run_dir))


@pytest.fixture
def python_shim(tmp_path: Path) -> Path:
    """`commands.python`: records a hash of the secret the run sees, then execs the real python."""
    shim = tmp_path / "python"
    shim.write_text(
        "#!/bin/sh\n"
        'printf %s "$FLEET_TEST_SECRET" | sha256sum > "$FLEET_RUN_DIR/secret.sha256"\n'
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    return shim


@pytest.fixture
def target(tmp_path: Path, local_tmux: LocalTmux, python_shim: Path) -> Iterator[LocalTarget]:
    spec = TargetSpec(
        name="t",
        host="local",
        workdir=str(tmp_path / "work"),
        keep_releases=2,
        commands=Commands(python=str(python_shim)),
        run=RunSpec(
            module="training.selftest",
            config="selftest",
            overrides=("--selftest.steps=100000", "--selftest.step_seconds=0.05"),
            env=MappingProxyType({"FLEET_TEST_SECRET": SECRET}),
        ),
    )
    with open_target(spec) as t:
        assert isinstance(t, LocalTarget)
        try:
            yield t
        finally:  # pass or fail, no run outlives its test (a run survives its tmux server)
            with contextlib.suppress(FleetError):
                runs.stop_run(t, force=True, timeout_s=30)
            local_tmux.run("kill-session", "-t", f"={RUN_SESSION}", check=False)
            kill_processes_naming(spec.workdir)


def test_start_refuse_status_stop_status(target: LocalTarget, local_tmux: LocalTmux) -> None:
    assert runs.basic_status(target).state == "never"
    with pytest.raises(RunError, match="fab deploy"):
        runs.start_run(target)
    release = d.deploy(target, REPO)
    info = runs.start_run(target)
    assert info.release_id == release.id and info.run_dir.endswith(info.run_id)
    with pytest.raises(RunError, match=rf"{info.run_id}.*`fab stop`"):
        runs.start_run(target)
    wait_for("the first step", lambda: has_step(info.run_dir))
    status = runs.basic_status(target)
    assert status.state == "live" and status.run_id == info.run_id and status.release_id == release.id
    assert any(line.startswith("step ") for line in status.last_lines)
    assert local_tmux.run(
        "show-options", "-w", "-t", f"={RUN_SESSION}:", "remain-on-exit"
    ).stdout.split() == [
        "remain-on-exit",
        "on",
    ]

    stopped = runs.stop_run(target, timeout_s=60)
    assert stopped.state == "exited" and stopped.exit_code == 0, stopped.text()
    assert "SIGTERM" in stopped.message
    events = events_of(info.run_dir)
    assert [e["phase"] for e in events if e["event"] == "phase"][-2:] == ["checkpoint", "stopped"]
    assert all(validate_event(e) == [] for e in events)
    assert (Path(info.run_dir) / "exit_code").read_text().strip() == "0"
    after = runs.basic_status(target)
    assert after.state == "exited" and after.exit_code == 0 and after.run_id == info.run_id
    assert "Stopped by signal 15" in runs.read_log(target, 5)
    again = runs.stop_run(target)
    assert again.state == "exited" and "nothing was stopped" in again.message


def test_kill_9_of_the_trainer_is_reported_with_its_code(target: LocalTarget) -> None:
    d.deploy(target, REPO)
    info = runs.start_run(target)
    wait_for("the first step", lambda: has_step(info.run_dir))
    trainer_pid = next(e["pid"] for e in events_of(info.run_dir) if e["event"] == "run_start")
    assert isinstance(trainer_pid, int)
    os.kill(trainer_pid, signal.SIGKILL)
    wait_for("the run to end", lambda: runs.basic_status(target, 0).state == "exited")
    status = runs.basic_status(target)
    assert status.exit_code == 128 + signal.SIGKILL
    assert "exited with code 137" in status.text()


def test_failing_run_records_its_exit_code_and_error_event(target: LocalTarget) -> None:
    spec = target.spec
    failing = replace(
        spec, run=replace(spec.run, overrides=("--selftest.fail_at=3", "--selftest.step_seconds=0"))
    )
    with open_target(failing) as t:
        d.deploy(t, REPO)
        info = runs.start_run(t)
        wait_for("the run to fail", lambda: runs.basic_status(t, 0).state == "exited")
        assert runs.basic_status(t).exit_code == 1
        kinds = [e["event"] for e in events_of(info.run_dir)]
        assert "error" in kinds and "done" not in kinds
        # An exited run does not block the next start; it gets a fresh run id and `latest`.
        second = runs.start_run(t)
        assert second.run_id != info.run_id
        assert os.readlink(Path(spec.workdir) / "runs" / "latest") == second.run_id


def test_force_stop_kills_the_group(target: LocalTarget) -> None:
    d.deploy(target, REPO)
    info = runs.start_run(target)
    wait_for("the first step", lambda: has_step(info.run_dir))
    pgid = int((Path(info.run_dir) / "pgid").read_text())
    stopped = runs.stop_run(target, force=True)
    assert stopped.state == "exited" and stopped.exit_code == 137 and "SIGKILL" in stopped.message
    alive = [
        p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid_and_state(p) == (pgid, True)
    ]
    assert alive == []


def _pgid_and_state(proc: Path) -> tuple[int, bool] | None:
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[2]), fields[0] != "Z"


def test_secrets_stay_out_of_argv_run_json_log_and_tmux(target: LocalTarget, local_tmux: LocalTmux) -> None:
    d.deploy(target, REPO)
    info = runs.start_run(target)
    run_dir = Path(info.run_dir)
    wait_for("the first step", lambda: has_step(info.run_dir))
    # The run saw the secret ...
    seen = (run_dir / "secret.sha256").read_text().split()[0]
    assert seen == hashlib.sha256(SECRET.encode()).hexdigest()
    # ... but it is nowhere else: not in any process's argv, files of the run dir, or tmux's environment.
    # The test's own processes (the run lives under the test's tmux server); other processes on
    # this machine are not this test's business, and may well spell the same fixed string.
    server = int(local_tmux.run("display-message", "-p", "#{pid}").stdout)
    own = descendants(os.getpid(), server)
    assert any(info.run_dir in argv_of(pid) for pid in own)  # the run is among them
    ps = subprocess.run(
        ["ps", "-ww", "-o", "args=", "-p", ",".join(map(str, own))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "training.selftest" in ps
    assert SECRET not in ps and "s3cr3t" not in ps
    assert not (run_dir / "run.env").exists()  # read by run.sh, then deleted
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"s3cr3t" not in path.read_bytes(), path
    record = json.loads((run_dir / "run.json").read_text())
    assert record["env_keys"] == ["FLEET_TEST_SECRET"] and record["release"] == info.release_id
    assert record["argv"] == list(info.argv)
    tmux_env = local_tmux.run("show-environment", "-t", f"={RUN_SESSION}").stdout
    tmux_env += local_tmux.run("show-environment", "-g").stdout
    assert "s3cr3t" not in tmux_env
    assert not Path("/tmp/fleet-pwned").exists()
    runs.stop_run(target)


def test_live_runs_release_is_never_pruned(target: LocalTarget) -> None:
    first = d.deploy(target, REPO)
    info = runs.start_run(target)
    wait_for("the first step", lambda: has_step(info.run_dir))
    later = [d.deploy(target, REPO).id for _ in range(3)]  # keep_releases = 2: the live run's counts
    releases = sorted(p.name for p in (Path(target.spec.workdir) / "releases").iterdir())
    assert first.id in releases and releases == sorted([first.id, later[-1]])
    assert runs.basic_status(target, 0).state == "live"  # its code was never touched
    runs.stop_run(target)
    d.deploy(target, REPO)  # stopped, it is runs/latest and may be continued: its release stays
    assert first.id in {p.name for p in (Path(target.spec.workdir) / "releases").iterdir()}
    runs.start_run(target)  # another run becomes runs/latest (on the current release)
    runs.stop_run(target)
    d.deploy(target, REPO)  # now it may go
    assert first.id not in {p.name for p in (Path(target.spec.workdir) / "releases").iterdir()}


def test_a_foreign_session_is_refused_and_never_signalled(target: LocalTarget, local_tmux: LocalTmux) -> None:
    """tmux's `fleet-run` is per container; a pane this workdir did not start is never touched."""
    local_tmux.run("new-session", "-d", "-s", RUN_SESSION, "sleep", "600")
    pane_pid = int(local_tmux.run("list-panes", "-t", f"={RUN_SESSION}:", "-F", "#{pane_pid}").stdout)
    d.deploy(target, REPO)
    status = runs.basic_status(target)
    assert status.state == "live" and status.foreign_pid == pane_pid and "not this workdir" in status.text()
    with pytest.raises(RunError, match="not a run of workdir"):
        runs.start_run(target)
    with pytest.raises(RunError, match="nothing was signalled"):
        runs.stop_run(target, force=True)
    assert _pgid_and_state(Path(f"/proc/{pane_pid}")) == (pane_pid, True)  # still running


def test_start_with_a_known_release_is_one_launch_that_skips_taken_run_ids(target: LocalTarget) -> None:
    release = d.deploy(target, REPO)
    with pytest.raises(RunError, match="not on the target"):
        runs.start_run(target, release_id="20200101T000000Z-abcdef1")
    now = dt.datetime.now(dt.UTC)
    taken = [runs.make_run_id(now + dt.timedelta(seconds=s), "selftest") for s in range(3)]
    for run_id in taken:
        (Path(target.spec.workdir) / "runs" / run_id).mkdir(parents=True)
    info = runs.start_run(target, release_id=release.id)
    assert info.run_id not in taken and info.run_id > taken[0]
    assert json.loads((Path(info.run_dir) / "run.json").read_text())["release"] == release.id
    with pytest.raises(RunError, match=info.run_id):
        runs.start_run(target, release_id=release.id)  # the launcher itself refuses a live run
    runs.stop_run(target)


def test_fab_logs_follow_streams_until_ctrl_c(tmp_path: Path, local_tmux: LocalTmux) -> None:
    """The user's path: `fab deploy train`, `fab logs --follow`, Ctrl-C -> exit 0, no traceback."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        f"""default_target = "here"
[targets.here]
host = "local"
workdir = {json.dumps(str(tmp_path / "work"))}
env = ""
[targets.here.run]
module = "training.selftest"
config = "selftest"
overrides = ["--selftest.steps=100000", "--selftest.step_seconds=0.05"]
[targets.here.commands]
python = {json.dumps(sys.executable)}
"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_CONFIG=str(config), PYTHONUNBUFFERED="1")
    fab = str(REPO / ".venv" / "bin" / "fab")
    started = subprocess.run([fab, "deploy", "train"], cwd=REPO, env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    follow = subprocess.Popen(
        [fab, "logs", "--follow", "-n", "5"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=ctrl_c_reaches_it,
    )
    try:
        assert follow.stdout is not None
        seen = [follow.stdout.readline() for _ in range(8)]  # blocks until the run has printed them
        assert any(line.startswith(b"step ") for line in seen), seen
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0 and b"Traceback" not in err, err
    stop = subprocess.run([fab, "stop"], cwd=REPO, env=env, capture_output=True, text=True)
    assert stop.returncode == 0 and "exited with code 0" in stop.stdout, stop.stdout + stop.stderr


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("--selftest.bogus=1", "unknown override --selftest.bogus"),
        ("--selftest.steps=many", "is not a number"),
        ("--selftest.steps=0", "must be >= 1"),
        ("stray", "unexpected argument"),
    ],
)
def test_selftest_bad_arguments_are_one_line_exit_2(tmp_path: Path, bad: str, says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "training.selftest", "train", "--run-dir", str(tmp_path), bad],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_selftest_runs_to_done_with_valid_events(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.selftest",
            "--run-dir",
            str(tmp_path),
            "--steps",
            "12",
            "--step-seconds",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "Batches per epoch: 19099 (min=2 max=64 avg=19.3)" in result.stdout
    assert "  Bucket 0 [   0, 770):  2120 batches ( 11.1%)" in result.stdout
    events = read_events(tmp_path / "events.jsonl")
    assert all(validate_event(e) == [] for e in events)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_start" and kinds.count("step") == 12 and "done" in kinds
    assert [e["phase"] for e in events if e["event"] == "phase"][-1] == "done"
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [10, 12]


@pytest.mark.hosts
def test_runs_through_ssh_and_pct(remote_fleet: RemoteFleet) -> None:
    """The same life cycle on the real test host: SSH -> pct shim -> LXC container 200."""
    from fleet.inventory import load_inventory

    hosts = remote_fleet.hosts
    remote_fleet.write(
        run={
            "module": "training.selftest",
            "config": "selftest",
            "overrides": ["--selftest.steps=100000", "--selftest.step_seconds=0.1"],
            "env": {"FLEET_TEST_SECRET": SECRET},
        }
    )
    spec = load_inventory(remote_fleet.config).targets["ct200"]

    def ct_events(run_dir: str) -> list[dict[str, object]]:
        text = hosts.pct_exec("cat", "--", f"{run_dir}/events.jsonl", check=False).stdout
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def ct_stepped(run_dir: str) -> bool:
        return any(e["event"] == "step" for e in ct_events(run_dir))

    with open_target(spec) as target:
        release = d.deploy(target, REPO)
        info = runs.start_run(target, release_id=release.id)  # the one-command launch
        with pytest.raises(RunError, match=info.run_id):
            runs.start_run(target)
        wait_for("the first step in the container", lambda: ct_stepped(info.run_dir))
        assert runs.basic_status(target).state == "live"
        ps = hosts.pct_exec("ps", "-eww", "-o", "args").stdout
        assert info.run_dir in ps and "s3cr3t" not in ps
        stopped = runs.stop_run(target)
        assert stopped.state == "exited" and stopped.exit_code == 0, stopped.text()

        second = runs.start_run(target)
        wait_for("the second run's first step", lambda: ct_stepped(second.run_dir))
        pid = next(e["pid"] for e in ct_events(second.run_dir) if e["event"] == "run_start")
        hosts.pct_exec("kill", "-9", str(pid))
        wait_for("the killed run to be seen", lambda: runs.basic_status(target, 0).state == "exited")
        assert runs.basic_status(target).exit_code == 137
        assert "s3cr3t" not in runs.read_log(target, 200)


def test_run_with_env_delivers_the_env_on_stdin_never_in_argv(tmp_path: Path) -> None:
    """The command sees run.env's values; its argv and its parents' argv (`ps`) never hold them."""
    spec = TargetSpec(
        name="t",
        host="local",
        workdir=str(tmp_path),
        run=RunSpec(module="training", config="tiny-cpu", env={"TOKEN": SECRET}),
    )
    (tmp_path / "current").mkdir()
    probe = (
        'printf "%s" "$TOKEN" | sha256sum | cut -c1-16; '
        'for pid in $$ $PPID; do tr "\\0" " " < /proc/$pid/cmdline; echo; done'
    )
    with open_target(spec) as target:
        res = runs.run_with_env(target, ["sh", "-c", probe])
    assert res.exit_code == 0, res.stderr
    digest = hashlib.sha256(SECRET.encode()).hexdigest()[:16]
    lines = res.stdout.splitlines()
    assert lines[0] == digest
    assert all("pwned" not in line and SECRET not in line for line in lines[1:]), lines
    assert res.argv == ("sh", "-c", probe)  # what an error would show: the command, not the wrapper


def test_failure_summary_picks_the_line_that_says_why() -> None:
    warm = (
        'lots of progress\nTraceback (most recent call last):\n  File "w.py", line 3, in f\nRuntimeError: x\n'
    )
    assert (
        runs.failure_summary(warm + "warm: failed at bucket 0 [0, 65): E\n", 1)
        == "warm: failed at bucket 0 [0, 65): E"
    )
    assert (
        runs.failure_summary(warm + "\nSet TORCHDYNAMO_VERBOSE=1 for more\n", 1)
        == "RuntimeError: x (at w.py:3)"
    )
    assert runs.failure_summary("error: bad config\n", 2) == "error: bad config"
    assert runs.failure_summary("", 9) == "exit 9"


def test_parse_resume_check_answers() -> None:
    got = runs.parse_resume_check("r1", "checkpoint 40 150 /w/runs/r1/checkpoints/step-00000040.pt\n")
    assert got == runs.Resume("r1", 40, 150, "/w/runs/r1/checkpoints/step-00000040.pt")
    assert runs.parse_resume_check("r1", "none\n") is None
    with pytest.raises(RunError):
        runs.parse_resume_check("r1", "something else\n")


def test_started_line_names_step_and_checkpoint_of_a_resume() -> None:
    info = runs.RunInfo("r1", "rel", "/w/runs/r1", (), "now", "t", resumed_from=40, checkpoint="/c.pt")
    assert runs.started_line("t", info).startswith("t: run r1 resumed at step 41 from checkpoint /c.pt")
    fresh = runs.RunInfo("r2", "rel", "/w/runs/r2", (), "now", "t")
    assert runs.started_line("t", fresh).startswith("t: run r2 started (release rel)")


def _run_dir(root: Path, run_id: str, *, exit_code: str | None, phase: str, step: int, ckpt: int) -> None:
    d = root / "runs" / run_id
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / f"step-{ckpt:08d}.pt").write_bytes(b"x" * 2048)
    (d / "checkpoints" / f"step-{max(ckpt - 5, 0):08d}.pt").write_bytes(b"x")
    if exit_code is not None:
        (d / "exit_code").write_text(exit_code + "\n")
    step_ev = {
        "v": 1,
        "ts": 1.0,
        "event": "step",
        "rank": 0,
        "role": "single",
        "step": step,
        "total_steps": 60,
    }
    phase_ev = {"v": 1, "ts": 2.0, "event": "phase", "rank": 0, "role": "single", "phase": phase}
    compact = {"separators": (",", ":")}  # as training.events writes them
    (d / "events.jsonl").write_text(json.dumps(step_ev, **compact) + "\n" + json.dumps(phase_ev) + "\n")
    (d / "segments.jsonl").write_text('{"segment": 1}\n{"segment": 2}\n')


def test_runs_list_script_lists_and_prunes_old_runs_but_never_the_latest(tmp_path: Path) -> None:
    """The shipped script on a real file tree: the newest KEEP stay, runs/latest stays even when old."""
    ids = [f"2026113{i}T000000Z-tiny-cpu" for i in range(5)]
    _run_dir(tmp_path, ids[0], exit_code="0", phase="stopped", step=20, ckpt=20)  # latest, but oldest
    _run_dir(tmp_path, ids[1], exit_code="137", phase="train", step=33, ckpt=30)
    _run_dir(tmp_path, ids[2], exit_code="0", phase="done", step=60, ckpt=60)
    _run_dir(tmp_path, ids[3], exit_code="1", phase="error", step=3, ckpt=0)
    _run_dir(tmp_path, ids[4], exit_code="0", phase="done", step=60, ckpt=60)
    (tmp_path / "runs" / "latest").symlink_to(ids[0])

    def listing(keep: int) -> tuple[list[runs.RunSummary], list[str]]:
        out = subprocess.run(
            remote.sh("runs_list.sh", str(tmp_path), str(keep)), capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return runs.parse_runs_list(out.stdout)

    found, removed = listing(0)
    assert removed == [] and [r.run_id for r in found] == ids
    assert [r.state for r in found] == ["stopped", "failed", "finished", "failed", "finished"]
    assert (found[1].step, found[1].total_steps, found[1].checkpoint_step, found[1].launches) == (
        33,
        60,
        30,
        2,
    )
    assert found[0].latest and not found[1].latest and (found[0].size_kib or 0) >= 2
    assert "(latest)" in runs.runs_text("t", found) and "33/60" in runs.runs_text("t", found)

    found, removed = listing(2)
    assert sorted(removed) == [ids[1], ids[2]]  # beyond the newest two; ids[0] is runs/latest
    assert [r.run_id for r in found] == [ids[0], ids[3], ids[4]]


def _ship_wrapper(release: Path) -> None:
    """remote/run.sh as a release holds it (the contract's names filled in by the deploy)."""
    wrapper = release / "remote" / "run.sh"
    wrapper.write_bytes(d.release_file("remote/run.sh", remote.path("run.sh")))


def _wrapper(tmp_path: Path, name: str, script: str, restart_max: int) -> tuple[int, Path]:
    """Run the shipped run.sh (real bash) on a command; the restart policy as fleet sends it."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    spec = TargetSpec(name="t", host="local", workdir=str(tmp_path), run=RunSpec(restart_max=restart_max))
    env = runs.wrapper_env(spec) | {"FLEET_RESTART_BACKOFF_S": "1"}
    (run_dir / "run.env").write_bytes(runs.env_file_text(env))
    release = tmp_path / "release"  # what a release holds for the wrapper: its helpers and training/
    if not release.exists():
        (release / "remote").mkdir(parents=True)
        shutil.copy(remote.path("run_cause.py"), release / "remote")
        _ship_wrapper(release)
        (release / "training").symlink_to(Path(training.__file__).parent)
    # The trainer's argv starts with the run's python, as in a real run (the wrapper's helpers use it).
    call_sh = f"import subprocess, sys; sys.exit(subprocess.call(['sh', '-c', {script!r}]))"
    trainer = [sys.executable, "-c", call_sh]
    argv = ["bash", str(release / "remote" / "run.sh"), str(run_dir), str(release), *trainer]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).returncode, run_dir


def _attempts(run_dir: Path) -> list[dict]:
    text = (run_dir / "attempts.jsonl").read_text() if (run_dir / "attempts.jsonl").exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def test_run_wrapper_restarts_a_failed_trainer_but_never_a_cause_a_restart_cannot_fix(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    # Killed once (exit 137), then it succeeds: one restart, recorded.
    flaky = f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; [ "$n" -ge 1 ] || exit 137'
    code, run_dir = _wrapper(tmp_path, "flaky", flaky, restart_max=2)
    assert code == 0 and (run_dir / "exit_code").read_text() == "0\n"
    assert [(a["attempt"], a["exit_code"], a["retry"]) for a in _attempts(run_dir)] == [(1, 137, True)]
    log = (run_dir / "train.log").read_text()
    assert "restart 1 of 2" in log and "FLEET_NO_RETRY" not in log
    # Always failing: max restarts, then the wrapper gives up with the trainer's exit status.
    code, run_dir = _wrapper(tmp_path, "broken", "exit 3", restart_max=2)
    assert code == 3 and [a["retry"] for a in _attempts(run_dir)] == [True, True, False]
    # A config error (exit 2) and a drifted env (an import error) are never retried.
    code, run_dir = _wrapper(tmp_path, "config", "echo 'error: bad key' >&2; exit 2", restart_max=2)
    assert code == 2 and _attempts(run_dir) == [{**_attempts(run_dir)[0], "retry": False}]
    assert _attempts(run_dir)[0]["cause"] == "config-error (not retryable)"
    code, run_dir = _wrapper(tmp_path, "drift", "echo 'ModuleNotFoundError: No module named x'; exit 1", 2)
    assert code == 1 and _attempts(run_dir)[0]["cause"] == "import-error (not retryable)"
    # Without a policy nothing is recorded and nothing restarts.
    code, run_dir = _wrapper(tmp_path, "off", "exit 137", restart_max=0)
    assert code == 137 and _attempts(run_dir) == []


_FAILURE_LINES = {  # a real line of each kind of failure, as torchrun's ranks print them
    "fx-trace-threads": "[rank1]: RuntimeError: Detected that you are using FX to symbolically trace a "
    "dynamo-optimized function. This is not supported at the moment.",
    "nvml-mismatch": "Failed to initialize NVML: Driver/library version mismatch",
    "import-error": "[rank0]: ModuleNotFoundError: No module named 'flashinfer'",
    "cuda-oom": "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "disk-full": "OSError: [Errno 28] No space left on device",
    "non-finite-loss": "error: non-finite loss at step 2 (loss nan, gradient norm nan): stopped before "
    "checkpointing it, the last good checkpoint is step 1",
}


def test_the_restart_decision_and_the_diagnosis_read_a_log_alike() -> None:
    """run_cause.py (what the wrapper runs) finds exactly the not-retryable diagnoses, on the same lines."""
    from fleet.status.diagnose import NOT_RETRYABLE, diagnose

    spec = importlib.util.spec_from_file_location("run_cause", remote.path("run_cause.py"))
    assert spec is not None and spec.loader is not None
    run_cause = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_cause)
    rows = runs.wrapper_env(TargetSpec(name="t", host="local", workdir="/w", run=RunSpec(restart_max=1)))[
        "FLEET_NO_RETRY"
    ]
    assert {sig for sig, _ in NOT_RETRYABLE} == {
        "fx-trace-threads",
        "nvml-mismatch",
        "import-error",
        "non-finite-loss",
    }
    for signature, line in _FAILURE_LINES.items():
        log = f"step 10\nTraceback (most recent call last):\n{line}\n"
        assert next(d.signature for d in diagnose(log)) == signature
        expected = signature if signature in {sig for sig, _ in NOT_RETRYABLE} else ""
        assert run_cause.first_cause(log, rows) == expected, (signature, line)


class _Hook:
    """A real HTTP server on 127.0.0.1 that records what each POST brought."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.received: list[tuple[str, dict[str, str], dict]] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                hook.received.append((self.path, dict(self.headers), json.loads(self.rfile.read(length))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def states(self) -> list[str]:
        return [body["state"] for _, _, body in self.received]


def test_run_wrapper_notifies_a_webhook_without_leaking_its_secrets(tmp_path: Path) -> None:
    hook = _Hook()
    secret, header_secret = "tok-9f2c1e", "bearer-77aa"
    notify = NotifySpec(
        url=f"{hook.url}/hook?token={secret}", headers={"Authorization": f"Bearer {header_secret}"}
    )

    def wrapped(
        name: str, script: str, restart_max: int = 0, stall_s: float = 600, backoff_s: float = 1
    ) -> Path:
        run_dir = tmp_path / name
        (run_dir / "remote").mkdir(parents=True)
        shutil.copy(remote.path("run_notify.py"), run_dir / "remote" / "run_notify.py")
        _ship_wrapper(run_dir)
        (run_dir / "training").symlink_to(Path(training.__file__).parent)  # the notifier imports it
        spec = TargetSpec(
            name="t", host="local", workdir=str(tmp_path), run=RunSpec(restart_max=restart_max),
            notify=notify, stall_window_s=stall_s,
        )  # fmt: skip
        env = runs.wrapper_env(spec) | {"FLEET_RESTART_BACKOFF_S": str(backoff_s)}
        (run_dir / "run.env").write_bytes(runs.env_file_text(env))
        argv = [
            "bash",
            str(run_dir / "remote" / "run.sh"),
            str(run_dir),
            str(run_dir),
            sys.executable,
            "-c",
            script,
        ]
        subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        return run_dir

    step = json.dumps({"v": 1, "ts": 1.0, "event": "step", "rank": 0, "role": "single", "step": 7})
    write_step = f"open('events.jsonl', 'a').write({step!r} + '\\n')"
    finished = wrapped("finished", f"import os; os.chdir({str(tmp_path / 'finished')!r}); {write_step}")
    assert hook.states() == ["finished"]
    path, headers, body = hook.received[0]
    assert path == f"/hook?token={secret}" and headers["Authorization"] == f"Bearer {header_secret}"
    assert body == {"target": "t", "run": "finished", "state": "finished", "step": 7, "cause": "", "fix": ""}

    # A back-off longer than the stall window is the wrapper waiting to restart, not a stall.
    wrapped("failing", "raise SystemExit(3)", restart_max=1, stall_s=0.5, backoff_s=2)
    assert hook.states()[1:] == ["restarted", "failed"]
    assert hook.received[-1][2]["cause"] == "exit 3" and "fab status" in hook.received[-1][2]["fix"]

    wrapped("stalling", "import time; time.sleep(4)", stall_s=1)
    assert "stalled" in hook.states()[3:] and hook.states()[-1] == "finished"
    stalled = next(b for _, _, b in hook.received if b["state"] == "stalled")
    assert stalled["run"] == "stalling" and "no new event or log output" in stalled["cause"]

    for _, _, body in hook.received:
        assert secret not in json.dumps(body) and header_secret not in json.dumps(body)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and header_secret.encode() not in data, path
    assert not finished.joinpath("run.env").exists()
    hook.server.shutdown()


def test_a_resume_launch_reuses_the_run_dir_and_a_failed_one_puts_it_back(
    target: LocalTarget, tmp_path: Path
) -> None:
    release = d.deploy(target, REPO)
    info = runs.start_run(target)
    wait_for("the first step", lambda: has_step(info.run_dir))
    runs.stop_run(target, timeout_s=60)
    run_dir = Path(info.run_dir)
    (run_dir / "attempts.jsonl").write_text(
        '{"attempt": 1, "exit_code": 137, "cause": "exit 137", "retry": true}\n'
    )
    before = {
        name: (run_dir / name).read_text() for name in ("exit_code", "run.json", "pgid", "attempts.jsonl")
    }
    plan = runs.LaunchPlan(
        release.id, info.run_id, runs.Resume(info.run_id, 4, 100000, "/c/step-00000004.pt")
    )

    # tmux cannot make the session: the launch fails, the run dir is as the first launch left it.
    real_tmux = target.spec.commands.tmux
    broken = tmp_path / "tmux-broken"
    broken.write_text(f'#!/bin/sh\ncase "$*" in *new-session*) exit 1 ;; esac\nexec {real_tmux} "$@"\n')
    broken.chmod(0o755)
    with open_target(replace(target.spec, commands=replace(target.spec.commands, tmux=str(broken)))) as t:
        with pytest.raises(RunError, match="could not start run"):
            runs.start_run(t, plan=plan)
    assert {name: (run_dir / name).read_text() for name in before} == before
    assert not (run_dir / "run.env").exists() and not (run_dir / "segments.jsonl").read_text().count("\n") > 1

    resumed = runs.start_run(target, plan=plan)
    assert (resumed.run_id, resumed.run_dir, resumed.resumed_from) == (info.run_id, info.run_dir, 4)
    segments = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    assert [(s["segment"], s["resumed_from"]) for s in segments] == [(1, None), (2, 4)]
    assert json.loads((run_dir / "run.json").read_text())["checkpoint"] == "/c/step-00000004.pt"
    assert not (run_dir / "attempts.jsonl").exists()  # the restart policy counts per launch
    assert (run_dir / "attempts-earlier.jsonl").read_text() == before["attempts.jsonl"]

    def steps_of_second_launch() -> bool:
        kinds = [e["event"] for e in events_of(info.run_dir)]
        starts = [i for i, k in enumerate(kinds) if k == "run_start"]
        return len(starts) == 2 and "step" in kinds[starts[1] :]

    wait_for("a step of the resumed launch", steps_of_second_launch)
    assert runs.basic_status(target, 0).state == "live"
    assert not (run_dir / "exit_code").exists()
    runs.stop_run(target, timeout_s=60)
    assert (run_dir / "exit_code").read_text() == "0\n"
