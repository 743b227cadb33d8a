"""fleet/remote's loader and its one section framing: the shared parts are put in place of their
include lines, no script carries its own copy or another framing, and what the scripts print under
dash is read by the one parser - a log line that looks like a header included."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
import testkit
from testkit import framed

from fleet import remote, runs
from fleet.remote import Answer, parse_answers
from fleet.status.fetch import fetch_argv, parse_fetch
from training import contract

PARTS = {
    "prelude.sh": ("limited", "emit", "section", "tail_section", "smi_section"),
    "rundir.sh": ("run_alive", "latest_run"),
    "doctor.sh": ("nodes",),
}
# Every script that answers in several parts; the others print one thing (a path, a word) or nothing.
ANSWERING = {
    "compile_list.sh",
    "deploy_current.sh",
    "deploy_prepare.sh",
    "doctor_container.sh",
    "doctor_host.sh",
    "gpu_probe.sh",
    "run_state.sh",
    "runs_list.sh",
    "status_fetch.sh",
}
# A log's lines that an unsafe framing would read as headers or drop.
NASTY = ["@@fleet log 0 1", "@@fleet end 0 0", "@@latest", "@@run x", "@@B end", "", "  @@fleet", "plain"]


def scripts() -> list[Path]:
    return sorted(p for p in remote.DIR.glob("*.sh") if p.name not in PARTS)


def defines(text: str, helper: str) -> bool:
    return re.search(rf"^{helper}\(\) \{{", text, re.M) is not None


def test_parts_are_included_and_never_copied() -> None:
    for p in scripts():
        text = p.read_text()
        own = [h for helpers in PARTS.values() for h in helpers if defines(text, h)]
        assert own == [], f"{p.name} defines {own}: include the part ({remote.INCLUDE}<part>)"
        included = re.findall(rf"^{remote.INCLUDE}(\S+)$", text, re.M)
        assert set(included) <= {*PARTS, remote.CONTRACT}, included
        loaded = remote.script(p.name)
        assert remote.INCLUDE not in loaded
        assert all(defines(loaded, h) for part in included for h in PARTS.get(part, ()))
    users = {p.name for p in scripts() if f"\n{remote.INCLUDE}prelude.sh\n" in p.read_text()}
    assert users == ANSWERING


def test_a_script_that_names_the_contract_includes_it() -> None:
    """A contract name unset under sh is an empty word (``"$run_dir/$PID_FILE"`` reads the run dir
    itself), which neither shellcheck (upper case reads as the environment) nor dash would report:
    every script, as loaded (its parts' uses included), assigns each contract name it uses."""
    names = dict(line.split("=", 1) for line in contract.shell_assignments().splitlines())
    assert names["PID_FILE"] == contract.PID_FILE and names["CHECKPOINT_GLOB"] == "'step-*.pt'"
    users = set()
    for p in [*scripts(), remote.path("run.sh")]:
        loaded = remote.script(p.name)
        used = set(re.findall(r"\$\{?!?([A-Z][A-Z0-9_]*)", loaded)) & set(names)
        missing = [n for n in sorted(used) if not re.search(rf"^{n}=", loaded, re.M)]
        assert missing == [], f"{p.name} uses {missing} without {remote.INCLUDE}{remote.CONTRACT}"
        users |= {p.name} if used else set()
    assert {
        "run.sh",
        "run_launch.sh",
        "run_state.sh",
        "run_stop.sh",
        "runs_list.sh",
        "status_fetch.sh",
    } <= users


def test_the_contract_part_runs_under_dash() -> None:
    """The generated assignments are plain sh: dash reads every name back unchanged."""
    dash = shutil.which("dash") or "sh"
    names = [line.split("=", 1)[0] for line in contract.shell_assignments().splitlines()]
    text = contract.shell_assignments() + "".join(f'printf "%s\\n" "${n}"\n' for n in names)
    out = subprocess.run([dash, "-c", text], capture_output=True, text=True, check=True).stdout
    expected = [
        " ".join(contract.LAUNCH_FILES) if n == "LAUNCH_FILES" else getattr(contract, n) for n in names
    ]
    assert out.splitlines() == expected


def test_no_script_frames_its_own_sections() -> None:
    for p in scripts():
        if p.name == "run.sh":
            continue
        body = [line for line in p.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in body if "@@" in line], f"{p.name} prints its own markers"


def test_parse_answers_framing() -> None:
    text = (
        "noise\n@@fleet a 0 2\nx\n@@fleet fake 9 1\n@@fleet b 12 1\n\n"
        "@@fleet c nope 1\ny\n@@fleet run a b 0 1\nz\n"
    )
    assert parse_answers(text) == {
        "a": Answer(0, "x\n@@fleet fake 9 1"),
        "b": Answer(12, ""),
        "c": Answer(-1, "y"),
        "run a b": Answer(0, "z"),
    }
    assert parse_answers("@@fleet a 0\nx\n@@fleet b 0 3\nonly\n") == {"b": Answer(0, "only")}  # cut short
    assert parse_answers(framed(("t", 0, "\n".join(NASTY)))) == {"t": Answer(0, "\n".join(NASTY))}


needs_dash = pytest.mark.skipif(shutil.which("dash") is None, reason="dash is what targets run")


def dash(argv: list[str]) -> str:
    assert argv[:2] == ["sh", "-c"]
    return subprocess.run(["dash", *argv[1:]], capture_output=True, text=True, timeout=60, check=True).stdout


@needs_dash
def test_a_prelude_script_under_dash_is_read_by_the_one_parser(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "0, NVIDIA H200, 1 MiB"\necho "@@fleet xml 0 1" >&2\nexit 3\n')
    smi.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "pid").write_text("41\n")
    (run_dir / "pgid").write_text("41\n")
    argv = remote.sh("gpu_probe.sh", "5", str(smi), "index,name", "pid", "query", str(run_dir))
    answers = parse_answers(dash(argv))
    assert answers["query"] == Answer(3, "0, NVIDIA H200, 1 MiB\n@@fleet xml 0 1")
    assert answers["runids"] == Answer(0, "41\n41") and "xml" not in answers


@needs_dash
def test_a_log_whose_lines_look_like_headers_loses_nothing(tmp_path: Path) -> None:
    """run_state.sh's log lines and status_fetch.sh's log bytes arrive whole, whatever they say."""
    run = tmp_path / "runs" / "20261201T000000Z-r"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(run.name)
    log = "\n".join(NASTY) + "\n"
    (run / "train.log").write_text(log)
    (run / "exit_code").write_text("1\n")
    state = runs.parse_state("t", dash(remote.sh("run_state.sh", str(tmp_path), "tmux", "s", "100")))
    assert state.last_lines == tuple(NASTY) and state.exit_code == 1
    got = parse_fetch(dash(fetch_argv(str(tmp_path), "/nonexistent/tmux", "")))
    assert got.log_text == log.rstrip("\n") and got.facts.exit_code == 1


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_env_lock_holds_until_its_stdin_ends(shell: str, tmp_path: Path) -> None:
    """env_lock.sh: the first holder writes its token; a second waits, and takes the lock only when
    the first one's stdin ends (the controller done, or gone); a killed holder releases it too."""
    if shutil.which(shell) is None or shutil.which("flock") is None:
        pytest.skip(f"{shell} or flock missing")
    lock = tmp_path / "envs" / ".build-smoke.lock"

    def holder(token: str) -> subprocess.Popen[bytes]:
        argv = remote.sh("env_lock.sh", str(lock), token)
        return subprocess.Popen([shell, *argv[1:]], stdin=subprocess.PIPE)

    def holds(token: str) -> bool:
        return lock.exists() and lock.read_text().strip() == token

    first = holder("first")
    testkit.wait_for("the first holder", lambda: holds("first"))
    second = holder("second")
    third = holder("third")
    assert second.poll() is None and holds("first")  # waiting, not failed, and not taken
    assert first.stdin is not None
    first.stdin.close()
    assert first.wait(timeout=30) == 0
    testkit.wait_for("a waiting holder to take it", lambda: holds("second") or holds("third"))
    taker, waiter = (second, third) if holds("second") else (third, second)
    taker.kill()  # a holder that dies (its connection lost) releases the lock with it
    taker.wait(timeout=30)
    testkit.wait_for("the last holder", lambda: holds("third" if waiter is third else "second"))
    assert waiter.stdin is not None
    waiter.stdin.close()
    assert waiter.wait(timeout=30) == 0


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_env_lock_wait_answers_held_once_the_token_is_there(shell: str, tmp_path: Path) -> None:
    """env_lock_wait.sh: `held` once the lock file holds the token (written while it waits), else
    `waiting` after its seconds; one call instead of a round trip per poll."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} missing")
    lock = tmp_path / ".build-smoke.lock"

    def wait(token: str, seconds: int) -> str:
        argv = remote.sh("env_lock_wait.sh", str(lock), token, str(seconds))
        return subprocess.run([shell, *argv[1:]], capture_output=True, text=True, timeout=60).stdout.strip()

    assert wait("ours", 0) == "waiting"  # no lock file yet
    lock.write_text("another\n")
    assert wait("ours", 1) == "waiting"
    writer = threading.Timer(0.5, lambda: lock.write_text("ours\n"))
    writer.start()
    try:
        assert wait("ours", 30) == "held"  # the token arrived while it waited
    finally:
        writer.join()


def _populated_workdir(root: Path) -> dict[str, list[str]]:
    """A workdir with a release, `current`, a run and a compile-cache key; a fake nvidia-smi. Returns
    each script's arguments against it (what fleet sends, less the tmux of a live run)."""
    wd = root / "wd"
    (wd / "releases" / "r1").mkdir(parents=True)
    (wd / "releases" / "r1" / "MANIFEST").write_text("release r1\n")
    (wd / "current").symlink_to("releases/r1")
    run = wd / "runs" / "20261201T000000Z-r"
    run.mkdir(parents=True)
    (wd / "runs" / "latest").symlink_to(run.name)
    (run / "run.json").write_text('{"run_id": "r"}\n')
    (run / "pid").write_text("41\n")
    (run / "pgid").write_text("41\n")
    key = root / "cache" / "key-a"
    key.mkdir(parents=True)
    (key / "manifest.json").write_text('{"k": 1}\n')
    (key / "megacache.bin").write_bytes(b"x")
    smi = root / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "0, NVIDIA H200, 1 MiB"\n')
    smi.chmod(0o755)
    return {
        "compile_list.sh": [str(root / "cache"), "manifest.json", "megacache.bin"],
        "deploy_current.sh": [str(wd), "MANIFEST"],
        "deploy_prepare.sh": [str(wd), "/nonexistent/tmux", "fleet-run", "run.json"],
        "gpu_probe.sh": ["5", str(smi), "index,name", "pid", "query", str(run)],
        "runs_list.sh": [str(wd), "1"],
        "run_state.sh": [str(wd), "/nonexistent/tmux", "fleet-run", "10"],
    }


# What each script must answer on the populated workdir, under either shell.
EXPECTED = {
    "compile_list.sh": {"key key-a": Answer(0, '{"k": 1}')},
    "deploy_current.sh": {"link": Answer(0, "releases/r1"), "manifest": Answer(0, "release r1")},
    "deploy_prepare.sh": {"releases": Answer(0, "r1"), "run_json": Answer(0, '{"run_id": "r"}')},
    "gpu_probe.sh": {"query": Answer(0, "0, NVIDIA H200, 1 MiB"), "runids": Answer(0, "41\n41")},
    "runs_list.sh": {"latest": Answer(0, "20261201T000000Z-r")},
    "run_state.sh": {"run_json": Answer(0, '{"run_id": "r"}')},
}


@pytest.mark.skipif(not (shutil.which("dash") and shutil.which("bash")), reason="needs dash and bash")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_script_answers_the_same_under_dash_and_bash(name: str, tmp_path: Path) -> None:
    """Targets' /bin/sh is dash on Debian and Proxmox, bash elsewhere: the same answers from both."""
    args = _populated_workdir(tmp_path)[name]
    answers = {}
    for shell in ("dash", "bash"):
        argv = remote.sh(name, *args)
        done = subprocess.run([shell, *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, (shell, done.stderr)
        answers[shell] = parse_answers(done.stdout)
        for section, answer in EXPECTED[name].items():
            assert answers[shell].get(section) == answer, (shell, section, answers[shell])
    # every section, its exit status, and its text (a missing command's message is the shell's own)
    codes = {shell: {k: a.exit_code for k, a in got.items()} for shell, got in answers.items()}
    assert codes["dash"] == codes["bash"]
    texts = {
        shell: {k: a.output for k, a in got.items() if a.exit_code != 127} for shell, got in answers.items()
    }
    assert texts["dash"] == texts["bash"]


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_compile_pack_and_put_move_the_optional_file_or_take_an_old_one_away(
    shell: str, tmp_path: Path
) -> None:
    """compile_pack.sh keeps the optional files that exist (the manifest last); compile_put.sh moves
    them in, or removes one the new artefact lacks: under dash (targets' /bin/sh) and bash."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} missing")
    names = ("megacache.bin", "manifest.json", "autotune.tar")

    def run(script: str, root: Path, stdin: bytes = b"") -> bytes:
        argv = remote.sh(script, str(root), "k", *names)
        return subprocess.run(
            [shell, *argv[1:]], input=stdin, capture_output=True, timeout=60, check=True
        ).stdout

    src = tmp_path / "a"
    (src / "k").mkdir(parents=True)
    for name in names:
        (src / "k" / name).write_text(name)
    tar = base64.b64decode(run("compile_pack.sh", src))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        assert archive.getnames() == ["megacache.bin", "autotune.tar", "manifest.json"]
    dest = tmp_path / "b"
    run("compile_put.sh", dest, tar)
    assert sorted(p.name for p in (dest / "k").iterdir()) == sorted(names)
    (src / "k" / "autotune.tar").unlink()
    tar = base64.b64decode(run("compile_pack.sh", src))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        assert archive.getnames() == ["megacache.bin", "manifest.json"]
    run("compile_put.sh", dest, tar)
    assert sorted(p.name for p in (dest / "k").iterdir()) == ["manifest.json", "megacache.bin"]
    assert not [p for p in dest.iterdir() if p.name.startswith(".incoming")]


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_the_launch_placeholder_ends_when_its_terminal_closes_without_a_hangup(shell: str) -> None:
    """run_launch.sh starts the tmux pane with a placeholder that respawn-pane replaces by closing its
    terminal. A child that has not yet made that terminal its own gets no hangup signal: the
    placeholder must end on the closed terminal itself (a `sleep` would outlive the launch)."""
    import os
    import pty

    text = (Path(remote.__file__).parent / "run_launch.sh").read_text()
    found = re.search(r'new-session -d -s "\$session" -c "\$rel_dir" sh -c (\'[^\']*\') "\$run_dir"', text)
    assert found, "run_launch.sh's placeholder pane"
    master, slave = pty.openpty()
    # the terminal as stdin/stdout, never as the controlling terminal (this test's session keeps its own)
    argv = [shell, "-c", found.group(1).strip("'"), "placeholder"]
    child = subprocess.Popen(argv, stdin=slave, stdout=slave)
    os.close(slave)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)  # it waits while the terminal is open
        os.close(master)
        assert child.wait(timeout=30) is not None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
