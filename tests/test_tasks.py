"""The Fabric entry: `fab --list`, the task boundary (one line + exit code), target fan-out."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import testkit
from invoke import Context
from invoke.exceptions import Exit

from fleet.cli import error_line, fleet_task, map_targets, on_targets, single_target
from fleet.errors import CommandFailed, ConfigError, DeployError, RunError
from fleet.target import Target

REPO = Path(__file__).resolve().parents[1]
TASKS = ("deploy", "train", "status", "logs", "stop")
SHORT_HELP = ("deploy", "train", "logs", "stop")  # these help lines fit in 80 columns

TWO_LOCAL = """
default_target = "a"
[targets.a]
host = "local"
workdir = "state/a"
[targets.b]
host = "local"
workdir = "state/b"
"""


def fab(
    *args: str, config: Path | None = None, target: str | None = None
) -> subprocess.CompletedProcess[str]:
    return testkit.fab(*args, config=config, env={"FLEET_TARGET": target} if target else None, timeout=300)


@pytest.fixture
def two_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = tmp_path / "fleet.toml"
    config.write_text(TWO_LOCAL)
    monkeypatch.setenv("FLEET_CONFIG", str(config))
    monkeypatch.delenv("FLEET_TARGET", raising=False)
    return config


def test_fab_list_shows_each_task_with_one_line_help() -> None:
    import tasks

    result = fab("--list")
    assert result.returncode == 0, result.stderr
    # `fab --list` wraps long help at the terminal width: join continuation lines back.
    shown: dict[str, str] = {}
    name = ""
    for line in result.stdout.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):
            name, _, help_text = line.strip().partition(" ")
            shown[name] = help_text.strip()
        elif line.strip() and name:
            shown[name] += " " + line.strip()
    assert set(TASKS) <= set(shown)
    for task_name, task in tasks.ns.tasks.items():
        doc = (task.__doc__ or "").strip()
        assert doc and "\n" not in doc and doc.endswith("."), f"{task_name}: help is not one line: {doc!r}"
        assert shown[task_name.replace("_", "-")] == doc
    for name in SHORT_HELP:  # ours fit on one line at 80 columns
        assert any(line.strip().endswith(shown[name]) for line in result.stdout.splitlines()), name


def test_task_errors_become_one_line_and_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    @fleet_task
    def boom(c: Context) -> None:
        """Fail like a deploy does."""
        raise DeployError("box: upload failed\n  (the previous release is still current)")

    with pytest.raises(Exit) as info:
        boom(Context())
    assert info.value.code == 4
    assert capsys.readouterr().err == "fleet: box: upload failed (the previous release is still current)\n"


def test_bugs_keep_their_traceback() -> None:
    @fleet_task(help={"x": "unused"})
    def bug(c: Context, x: int = 0) -> None:
        """A bug is not a FleetError."""
        raise ZeroDivisionError("bug")

    with pytest.raises(ZeroDivisionError):
        bug(Context())


def test_error_line_adds_the_target_once() -> None:
    failed = CommandFailed("pve", ["pct", "exec", "200", "--", "true"], 1, "boom")
    assert error_line(failed, "pve") == "fleet: pve: `pct exec 200 -- true` exited 1: boom"
    assert error_line(RunError("no run log"), "pve") == "fleet: pve: no run log"


def test_single_target_tags_errors_with_the_target(
    two_local: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    @fleet_task
    def fails(c: Context) -> None:
        """Raise inside a target."""
        with single_target(c) as target:
            raise RunError(f"nothing to stop in {target.spec.workdir}")

    with pytest.raises(Exit) as info:
        fails(Context())
    assert info.value.code == 5
    assert capsys.readouterr().err == f"fleet: a: nothing to stop in {two_local.parent / 'state' / 'a'}\n"


def test_fan_out_groups_output_and_reports_each_failure(
    two_local: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_TARGET", "all")

    def work(target: Target) -> str:
        result = target.run(["sh", "-c", 'printf "%s\\n" "$N"; [ "$N" = a ]'], env={"N": target.name})
        return f"{target.name} says {result.stdout.strip()}"

    with pytest.raises(Exit) as info:
        on_targets(None, work)
    assert info.value.code == 3  # b's command failed
    out, err = capsys.readouterr()
    assert out == "== a (local) ==\na says a\n== b (local) ==\n"
    assert err.startswith("fleet: b: `env -- N=*** sh -c") and err.count("\n") == 1

    monkeypatch.setenv("FLEET_TARGET", "b")
    assert on_targets(None, lambda t: f"only {t.name}") is None
    assert capsys.readouterr().out == "only b\n"


def test_map_targets_returns_each_outcome_in_inventory_order(
    two_local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fan-out behind on_targets: several targets -> (name, result or its FleetError); one -> raises."""
    monkeypatch.setenv("FLEET_TARGET", "all")

    def work(target: Target) -> str:
        if target.name == "a":
            raise RunError("a: no run")
        return f"{target.name} ok"

    (a, err), (b, text) = map_targets(None, work)
    assert (a, b, text) == ("a", "b", "b ok") and isinstance(err, RunError)
    with pytest.raises(ConfigError, match=r"^status --watch follows one target; set FLEET_TARGET"):
        map_targets(None, work, allow_many=False, why_one="status --watch follows one target")
    monkeypatch.setenv("FLEET_TARGET", "a")
    with pytest.raises(RunError, match="a: no run"):
        map_targets(None, work)


def test_fab_logs_on_every_target_and_follow_needs_one(two_local: Path) -> None:
    result = fab("logs", config=two_local, target="all")
    assert result.returncode == 5  # RunError: neither target has a run yet
    assert result.stdout == "== a (local) ==\n== b (local) ==\n"
    errors = result.stderr.splitlines()
    assert [line.split(":")[:2] for line in errors] == [["fleet", " a"], ["fleet", " b"]], result.stderr

    follow = fab("logs", "--follow", config=two_local, target="all")
    assert follow.returncode == 2
    assert follow.stderr == "fleet: this task needs one target; set FLEET_TARGET to one name, not all\n"


def test_fab_logs_without_a_run_is_a_run_error(two_local: Path) -> None:
    result = fab("logs", "-n", "5", config=two_local)
    assert result.returncode == 5
    assert result.stderr.startswith("fleet: a: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_fab_deploy_puts_a_release_in_place(two_local: Path) -> None:
    result = fab("deploy", config=two_local)
    assert result.returncode == 0, result.stderr
    current = two_local.parent / "state" / "a" / "current"
    assert current.is_symlink() and (current / "training" / "__init__.py").is_file()
    assert result.stdout.startswith("a: release ") and os.readlink(current).endswith(result.stdout.split()[2])


def test_a_closed_stdout_ends_a_task_quietly(tmp_path: Path) -> None:
    """`fab status --json | head -c0`: no BrokenPipeError traceback, exit 141 (128 + SIGPIPE)."""
    config = tmp_path / "fleet.toml"
    config.write_text(TWO_LOCAL)
    proc = testkit.fab_popen(
        "status", "--json", config=config, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before fab writes
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert stderr == "", stderr
