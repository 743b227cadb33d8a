"""The run's liveness as every remote script reads it, under dash (Debian's and Proxmox's /bin/sh)
and bash: a run whose lock is held is alive whatever tmux says; without the lock, its recorded
process group. Plus the launcher's whole-or-nothing environment file and the pane fields tmux
leaves empty."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import framed

from fleet import remote, runs
from fleet.status.fetch import parse_fetch

SHELLS = [s for s in ("dash", "bash") if shutil.which(s)]
pytestmark = pytest.mark.skipif(
    not shutil.which("flock") or len(SHELLS) < 2, reason="needs flock, dash, bash"
)


def run_script(shell: str, name: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [shell, "-c", remote.script(name), f"fleet-{name}", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """runs/20260101T000000Z-old: a process group that holds its lock, as run.sh and its trainer
    do, with no tmux anywhere; runs/20260101T000001Z-new: a finished run, runs/latest's."""
    old = tmp_path / "runs" / "20260101T000000Z-old"
    new = tmp_path / "runs" / "20260101T000001Z-new"
    old.mkdir(parents=True)
    new.mkdir()
    (new / "exit_code").write_text("0\n")
    (new / "lock").touch()
    os.symlink(new.name, tmp_path / "runs" / "latest")
    proc = subprocess.Popen(
        ["flock", str(old / "lock"), "sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    (old / "pgid").write_text(f"{proc.pid}\n")
    for _ in range(100):
        if subprocess.run(["flock", "-n", str(old / "lock"), "true"], check=False).returncode:
            break
        subprocess.run(["sleep", "0.05"], check=False)
    yield old, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def alive_lines(out: bytes) -> dict[str, str]:
    found = {}
    for name, part in remote.parse_answers(out.decode()).items():
        for line in part.output.splitlines():
            if name.startswith("run ") and line.startswith("alive "):
                found[name[4:]] = line[6:]
    return found


@pytest.mark.parametrize("shell", SHELLS)
def test_runs_list_sees_a_live_run_without_tmux_and_never_prunes_it(
    shell: str, tmp_path: Path, live_run: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    old, _ = live_run
    dead = tmp_path / "runs" / "20250101T000000Z-dead"
    dead.mkdir()
    (dead / "pgid").write_text("999999\n")
    res = run_script(shell, "runs_list.sh", str(tmp_path), "1")
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert remote.parse_answers(out)["removed"].output == dead.name and old.is_dir(), out
    assert alive_lines(res.stdout) == {old.name: "1", "20260101T000001Z-new": "0"}, out
    listed, removed = runs.parse_runs_list(out)
    assert [r.state for r in listed] == ["live", "stopped"] and removed == [dead.name]


@pytest.mark.parametrize("shell", SHELLS)
def test_the_process_group_alone_says_alive_under_either_shell(
    shell: str, tmp_path: Path, live_run: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    """A run dir without a lock file (from a wrapper before the lock): its recorded group, read in
    /proc (`kill -0 -- -PGID` is an error under dash)."""
    old, _ = live_run
    os.rename(old / "lock", old / "lock-aside")
    res = run_script(shell, "runs_list.sh", str(tmp_path), "0")
    assert alive_lines(res.stdout)[old.name] == "1", res.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_state_and_status_read_the_lock_and_stop_reaches_the_group_without_tmux(
    shell: str, tmp_path: Path, live_run: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    old, proc = live_run
    os.replace(tmp_path / "runs" / "latest", tmp_path / "runs" / "gone")
    os.symlink(old.name, tmp_path / "runs" / "latest")
    state = run_script(shell, "run_state.sh", str(tmp_path), "false", "fleet-run", "0")
    parsed = runs.parse_state("t", state.stdout.decode())
    assert (parsed.state, parsed.run_id) == ("live", old.name), state.stdout
    fetched = run_script(shell, "status_fetch.sh", str(tmp_path), "false", "fleet-run", "100", "", "")
    facts = parse_fetch(fetched.stdout.decode()).facts
    assert (facts.run_id, facts.alive) == (old.name, True), fetched.stdout

    stop = run_script(shell, "run_stop.sh", str(tmp_path), "false", "fleet-run", "TERM", "10")
    assert stop.stdout.decode().split()[0] == "gone", stop.stdout + stop.stderr
    assert proc.wait(10) == -signal.SIGTERM
    assert (old / "stop_signal").read_text() == "TERM\n"
    again = run_script(shell, "run_stop.sh", str(tmp_path), "false", "fleet-run", "TERM", "10")
    assert again.stdout.decode().strip() == "none"


@pytest.mark.parametrize("shell", SHELLS)
def test_a_dangling_latest_names_the_newest_run_dir(shell: str, tmp_path: Path) -> None:
    (tmp_path / "runs" / "20260101T000000Z-a").mkdir(parents=True)
    (tmp_path / "runs" / "20260101T000005Z-b").mkdir()
    os.symlink("20260101T000009Z-removed-by-hand", tmp_path / "runs" / "latest")
    state = run_script(shell, "run_state.sh", str(tmp_path), "false", "fleet-run", "0")
    assert runs.parse_state("t", state.stdout.decode()).run_id == "20260101T000005Z-b"


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("cut", [0, 10, -1], ids=["empty", "short", "no-trailer"])
def test_the_launcher_refuses_an_environment_file_cut_short(shell: str, tmp_path: Path, cut: int) -> None:
    (tmp_path / "releases" / "r1" / "remote").mkdir(parents=True)
    (tmp_path / "releases" / "r1" / "remote" / "run.sh").write_text("exit 0\n")
    env = runs.env_file_text({"SECRET_A": "a" * 40, "SECRET_B": "b" * 40})
    sent = env[:cut] if cut >= 0 else env[: env.rindex(b"#")]
    args = [str(tmp_path), "false", "fleet-run", "20260101T000000Z-x", "r1", "new", "{}", "python3"]
    res = run_script(shell, "run_launch.sh", *args, stdin=sent)
    assert res.returncode == runs.EXIT_SHORT_ENV, res.stderr
    assert b"arrived incomplete" in res.stderr and b"aaaa" not in res.stderr
    assert list((tmp_path / "runs").iterdir()) == [], "a run dir (with a secret) was left behind"


@pytest.mark.parametrize("shell", SHELLS)
def test_the_launcher_refuses_while_any_run_dir_is_live(
    shell: str, tmp_path: Path, live_run: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    old, _ = live_run
    (tmp_path / "releases" / "r1" / "remote").mkdir(parents=True)
    (tmp_path / "releases" / "r1" / "remote" / "run.sh").write_text("exit 0\n")
    args = [str(tmp_path), "false", "fleet-run", old.name, "r1", "resume", "{}", "python3"]
    res = run_script(shell, "run_launch.sh", *args, stdin=runs.env_file_text({}))
    assert res.returncode == runs.EXIT_LIVE, res.stderr
    assert old.name.encode() in res.stderr


def test_a_dead_pane_with_empty_status_fields_is_no_exit_code() -> None:
    """tmux prints `#{pane_dead_status}` empty for a pane killed by a signal, and both empty when
    it cannot tell: no field may slide into another's place (the pane pid read as a signal)."""

    def body(pane: str) -> str:
        parts = (("now", "1700000000"), ("run", "r1"), ("pane", pane), ("pid", "528"), ("end", ""))
        return framed(*((name, 0, text) for name, text in parts))

    killed = parse_fetch(body("1  9 528")).facts
    unknown = parse_fetch(body("1   528")).facts
    assert (killed.alive, killed.exit_code) == (False, 137)
    assert (unknown.alive, unknown.exit_code) == (False, None)
