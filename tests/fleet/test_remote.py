"""fleet/remote's loader and its one section framing: the prelude is put in place of the marker line,
no script carries its own copy, and what a prelude script prints under dash is read by the one parser."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import testkit

from fleet import remote
from fleet.remote import Answer, parse_answers

HELPERS = ("limited", "emit", "section", "smi_section")


def scripts() -> list[Path]:
    return sorted(p for p in remote.DIR.glob("*.sh") if p.name != "prelude.sh")


def test_prelude_scripts_get_it_and_none_defines_its_helpers() -> None:
    users = [p.name for p in scripts() if f"\n{remote.PRELUDE_LINE}\n" in p.read_text()]
    assert {"doctor_host.sh", "doctor_container.sh", "gpu_probe.sh"} <= set(users)
    for p in scripts():
        own = [h for h in HELPERS if re.search(rf"^{h}\(\) \{{", p.read_text(), re.M)]
        assert own == [], f"{p.name} defines {own}: use the prelude ({remote.PRELUDE_LINE})"
    for name in users:
        text = remote.script(name)
        assert remote.PRELUDE_LINE not in text and all(
            re.search(rf"^{h}\(\) \{{", text, re.M) for h in HELPERS
        )


@pytest.mark.skipif(shutil.which("dash") is None, reason="dash is what targets run")
def test_a_prelude_script_under_dash_is_read_by_the_one_parser(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "0, NVIDIA H200, 1 MiB"\necho oops >&2\nexit 3\n')
    smi.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "pid").write_text("41\n")
    (run_dir / "pgid").write_text("41\n")
    argv = remote.sh("gpu_probe.sh", "5", str(smi), "index,name", "pid", "query", str(run_dir))
    out = subprocess.run(["dash", *argv[1:]], capture_output=True, text=True, timeout=60, check=True).stdout
    answers = parse_answers(out)
    assert answers["query"] == Answer(3, "0, NVIDIA H200, 1 MiB\noops")
    assert answers["runids"] == Answer(0, "41\n41")


def test_parse_answers_framing() -> None:
    text = "noise\n@@fleet a 0\nx\n\n@@fleet b 12\n@@fleet c nope\ny\n"
    assert parse_answers(text) == {"a": Answer(0, "x"), "b": Answer(12, ""), "c": Answer(-1, "y")}


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
