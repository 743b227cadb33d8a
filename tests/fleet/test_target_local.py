"""The local target with real subprocesses: argv is literal, env is explicit and masked,
put_tar is one command, container wrapping goes through `pct exec ID --` (a shim: pct is
Proxmox-only), and a stopped container is reported as such."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.errors import CommandFailed, TargetError
from fleet.inventory import Commands, ContainerSpec, TargetSpec
from fleet.target import CONTAINER_BASE_ENV, CommandResult, LocalTarget, open_target

HOSTILE = [
    "a;touch {m}",
    "$(touch {m})",
    "`touch {m}`",
    "'; touch {m}; '",
    '"; touch {m}; "',
    "two words",
    "|| touch {m}",
    "line\ntouch {m}",
    "*",
    "",
]


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a hostile string was executed"


def local(tmp_path: Path, **kwargs: object) -> LocalTarget:
    spec = TargetSpec(name="t", host="local", workdir=str(tmp_path / "w"), **kwargs)  # type: ignore[arg-type]
    target = open_target(spec)
    assert isinstance(target, LocalTarget)
    return target


def tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_hostile_argv_is_passed_literally(tmp_path: Path, marker: Path) -> None:
    args = [s.format(m=marker) for s in HOSTILE]
    with local(tmp_path) as target:
        result = target.run(["printf", "%s\\0", *args])
    assert result == CommandResult(("printf", "%s\\0", *args), 0, "\0".join(args) + "\0", "")


def test_hostile_cwd_and_env_are_literal(tmp_path: Path, marker: Path) -> None:
    cwd = tmp_path / f"dir with $(touch {marker}) `x` ;'\""
    cwd.mkdir(parents=True)  # the marker path's slashes make nested folders: still one literal path
    value = f"v; $(touch {marker}) `touch {marker}` '\""
    with local(tmp_path) as target:
        result = target.run(["sh", "-c", 'pwd; printf "%s" "$FLEET_T"'], cwd=str(cwd), env={"FLEET_T": value})
    assert result.stdout == f"{cwd}\n{value}"


def test_env_values_are_masked_in_errors(tmp_path: Path) -> None:
    secret = "hunter2-very-secret"
    with local(tmp_path) as target, pytest.raises(CommandFailed) as info:
        target.run(["sh", "-c", 'echo "token is $TOKEN" >&2; exit 7'], env={"TOKEN": secret})
    err = info.value
    assert secret not in str(err) and secret not in err.stderr_tail
    assert "TOKEN=***" in str(err) and "token is ***" in str(err)
    assert (err.target, err.command_exit_code, err.exit_code) == ("t", 7, 3)
    assert str(err).startswith("t: `env -- TOKEN=*** sh -c")


def test_check_false_returns_the_failure(tmp_path: Path) -> None:
    with local(tmp_path) as target:
        result = target.run(["sh", "-c", "echo out; echo err >&2; exit 4"], check=False)
    assert result == CommandResult(("sh", "-c", "echo out; echo err >&2; exit 4"), 4, "out\n", "err\n")
    assert not result.ok


def test_missing_command_and_missing_cwd_have_hints(tmp_path: Path) -> None:
    with local(tmp_path) as target:
        with pytest.raises(CommandFailed, match=r"exited 127.*\[targets\.t\.commands\]"):
            target.run(["fleet-no-such-command"])
        with pytest.raises(CommandFailed, match=r"exited 125.*working directory"):
            target.run(["true"], cwd=str(tmp_path / "absent"))


def test_stdin_is_binary_safe(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    with local(tmp_path) as target:
        result = target.run(["sh", "-c", "od -An -v -tx1 | wc -w"], stdin=data)
    assert result.stdout.strip() == str(len(data))


def test_timeout_stops_the_command(tmp_path: Path) -> None:
    with local(tmp_path) as target, pytest.raises(TargetError, match=r"did not finish within 0\.5s"):
        target.run(["sleep", "30"], timeout=0.5)


def test_run_stream_echoes_and_captures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with local(tmp_path) as target:
        result = target.run_stream(["sh", "-c", "echo progress; echo warn >&2"])
    assert (result.stdout, result.stderr) == ("progress\n", "warn\n")
    out, err = capsys.readouterr()
    assert "progress" in out and "warn" in err


def test_put_tar_extracts_one_stream(tmp_path: Path, marker: Path) -> None:
    files = {
        "training/__init__.py": b"",
        "training/data with space.bin": bytes(range(256)) * 2000,
        "MANIFEST.json": b'{"id": "x"}',
    }
    dest = tmp_path / f"releases/.tmp-$(touch {marker}) x"
    with local(tmp_path) as target:
        target.put_tar(io.BytesIO(tar_of(files)), str(dest))
    for name, data in files.items():
        assert (dest / name).read_bytes() == data


def test_put_tar_takes_an_iterator_of_chunks(tmp_path: Path) -> None:
    data = tar_of({"a.txt": b"a" * 300_000})
    chunks = (data[i : i + 1000] for i in range(0, len(data), 1000))
    with local(tmp_path) as target:
        target.put_tar(chunks, str(tmp_path / "d"))
    assert (tmp_path / "d" / "a.txt").read_bytes() == b"a" * 300_000


def test_put_tar_of_garbage_fails(tmp_path: Path) -> None:
    with local(tmp_path) as target, pytest.raises(CommandFailed, match="tar"):
        target.put_tar(io.BytesIO(b"not a tar archive" * 100), str(tmp_path / "d"))


def test_put_tar_producer_error_surfaces(tmp_path: Path) -> None:
    def broken() -> Iterator[bytes]:
        yield tar_of({"a": b"x"})[:512]
        raise OSError("disk went away")

    with local(tmp_path) as target, pytest.raises(OSError, match="disk went away"):
        target.put_tar(broken(), str(tmp_path / "d"))


# --- container wrapping (a pct stand-in; the real one is Proxmox-only) ---------------------------------


@pytest.fixture
def pct_shim(tmp_path: Path) -> tuple[Path, Path]:
    """A `pct` that logs its argv, runs `exec ID -- argv` here, and answers `status ID` from a file."""
    log = tmp_path / "pct.log"
    state = tmp_path / "pct.state"
    state.write_text("running")
    shim = tmp_path / "pct"
    shim.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> "{log}"\n'
        'case "$1" in\n'
        f'  exec) [ "$(cat "{state}")" = running ] || {{ echo "CT $2 not running" >&2; exit 255; }}\n'
        '        shift 3; exec "$@" ;;\n'
        f'  status) echo "status: $(cat "{state}")" ;;\n'
        "esac\n"
    )
    shim.chmod(0o755)
    return shim, state


def test_container_layers_argv_env_and_pct(tmp_path: Path, pct_shim: tuple[Path, Path]) -> None:
    shim, _ = pct_shim
    target = local(tmp_path, container=ContainerSpec("pct", id=200), commands=Commands(pct=str(shim)))
    # Inside a container the command starts from a fixed environment (`env -i` + base + caller's),
    # whatever pct keeps (PVE 8 keeps the SSH session's variables, PVE 9 clears them).
    base = [f"{k}={v}" for k, v in CONTAINER_BASE_ENV.items()]
    assert target.command_for(["python3", "-m", "x"], env={"A": "1"}, cwd="/w") == [
        str(shim), "exec", "200", "--", "env", "-i", "-C", "/w", "--", *base, "A=1", "python3", "-m", "x",
    ]  # fmt: skip
    assert target.command_for(["ls"], where="host") == ["ls"]
    assert target.command_for(["x"], env={"A": "s3cret"}, masked=True)[-2:] == ["A=***", "x"]
    result = target.run(["sh", "-c", 'printf "%s" "$A"'], env={"A": "a b;c"}, cwd=str(tmp_path))
    assert result.stdout == "a b;c"
    logged = (tmp_path / "pct.log").read_text()
    assert logged.startswith(f"exec 200 -- env -i -C {tmp_path} -- {' '.join(base)} A=a b;c sh")


def test_stopped_container_is_named(tmp_path: Path, pct_shim: tuple[Path, Path]) -> None:
    shim, state = pct_shim
    state.write_text("stopped")
    target = local(tmp_path, container=ContainerSpec("pct", id=200), commands=Commands(pct=str(shim)))
    with pytest.raises(TargetError) as info:
        target.run(["true"], check=False)  # even unchecked: nothing ran
    assert not isinstance(info.value, CommandFailed)
    assert str(info.value) == (
        "t: container 200 is not running on local container 200 (status: stopped); "
        "start it with `pct start 200`"
    )
    assert "status 200" in (tmp_path / "pct.log").read_text()


def test_failure_in_a_running_container_is_the_commands_own(
    tmp_path: Path, pct_shim: tuple[Path, Path]
) -> None:
    shim, _ = pct_shim
    target = local(tmp_path, container=ContainerSpec("pct", id=200), commands=Commands(pct=str(shim)))
    with pytest.raises(CommandFailed, match="exited 3"):
        target.run(["sh", "-c", "exit 3"])
    assert target.run(["sh", "-c", "exit 3"], check=False).exit_code == 3


def test_workdir_env_is_not_inherited_by_accident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only what is passed is added; the command sees this process's environment otherwise.
    monkeypatch.setenv("FLEET_TEST_AMBIENT", "1")
    with local(tmp_path) as target:
        out = target.run(["sh", "-c", 'printf "%s|%s" "$FLEET_TEST_AMBIENT" "${FLEET_X-unset}"']).stdout
    assert out == "1|unset"
    assert os.environ.get("FLEET_X") is None


def test_a_daemon_holding_the_output_pipe_does_not_hang_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fleet.target.DRAIN_S", 0.5)
    with local(tmp_path) as target:
        result = target.run(["sh", "-c", "sleep 5 & echo started"], timeout=30)
    assert (result.exit_code, result.stdout) == (0, "started\n")
