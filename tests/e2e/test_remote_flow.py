"""End to end through the real test host: `fab` -> SSH (127.0.0.1) -> pct shim -> LXC container 200.

Nothing is mocked on the way: a real sshd with its own host key, a real container with its own
rootfs and process tree, real tmux inside it, the real `fab` as a subprocess. Files inside the
container are checked through the shim (`pct exec 200 -- ...`), i.e. from the container's view.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import testkit

if TYPE_CHECKING:
    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts
wait_for = functools.partial(testkit.wait_for, interval=0.3)  # each check is a command on the test host

FINAL_STATES = ("finished", "stopped", "failed")
LONG_RUN = ["--selftest.steps=100000", "--selftest.step_seconds=0.2"]
RELEASE_RE = re.compile(r"release (\d{8}T\d{6}Z-[0-9a-f]{7}(?:-dirty)?) is current")


# ------------------------------------------------------------------ helpers


def ct_read(hosts: TestHost, path: str) -> str | None:
    """A file's text inside the container, or None when it does not exist."""
    result = hosts.pct_exec("cat", "--", path, check=False)
    return result.stdout if result.returncode == 0 else None


def ct_readlink(hosts: TestHost, path: str) -> str | None:
    result = hosts.pct_exec("readlink", "--", path, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def ct_listdir(hosts: TestHost, path: str) -> list[str]:
    result = hosts.pct_exec("ls", "-A", "--", path, check=False)
    return result.stdout.split() if result.returncode == 0 else []


def tree_digest(hosts: TestHost, path: str) -> str:
    """A digest of every file under ``path`` in the container (names, sizes and contents)."""
    listing = hosts.pct_exec(
        "sh", "-c", 'cd -- "$1" && find . -type f | sort | xargs -r sha256sum', "digest", path
    )
    assert listing.stdout.strip(), f"no files under {path}"
    return hashlib.sha256(listing.stdout.encode()).hexdigest()


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The task's error: exactly one non-empty line on stderr, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    return lines[0]


def released(result: subprocess.CompletedProcess[str]) -> str:
    match = RELEASE_RE.search(result.stdout)
    assert match, f"no release id in: {result.stdout!r} / {result.stderr!r}"
    return match.group(1)


def status_json(fleet: RemoteFleet, expect_code: int | None = None) -> dict[str, Any]:
    """`fab status --json` of the target (exit code = the state's, see fleet/status/model.py)."""
    result = fleet.fab("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    if expect_code is not None:
        assert result.returncode == expect_code, result.stdout + result.stderr
    return json.loads(result.stdout)


def markers_absent(hosts: TestHost, *names: str) -> None:
    for name in names:
        assert not Path("/tmp", name).exists(), f"/tmp/{name} appeared on the host: something was executed"
        check = hosts.pct_exec("test", "-e", f"/tmp/{name}", check=False)
        assert check.returncode == 1, f"/tmp/{name} appeared in the container: something was executed"


def run_pids(hosts: TestHost, run_dir_part: str) -> list[int]:
    """PIDs (host view) of the selftest's python processes whose command line names ``run_dir_part``."""
    return [
        pid
        for pid, argv in processes()
        if b"python" in argv[0].rsplit(b"/", 1)[-1]
        and b"training.selftest" in argv
        and any(run_dir_part.encode() in arg for arg in argv)
    ]


# ------------------------------------------------------------------ the main flow


def test_status_before_any_run_says_never_started(remote_fleet: RemoteFleet) -> None:
    """Before any run, status says so (as a state or as one line naming `fab train`)."""
    deployed = remote_fleet.fab("deploy")
    assert deployed.returncode == 0, deployed.stderr
    never = remote_fleet.fab("status")
    if never.returncode == 0:
        assert "never" in never.stdout.lower(), never.stdout
    else:  # the full status model answers with a RunError naming the next step
        assert never.returncode == 5, never.stdout + never.stderr
        assert "fab train" in one_line_error(never)


def test_deploy_train_status_logs_stop(remote_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    fleet.write(run={"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {}})

    started = fleet.fab("deploy", "train")
    assert started.returncode == 0, started.stderr
    release = released(started)
    assert ct_readlink(hosts, f"{workdir}/current") == f"releases/{release}"
    assert ct_read(hosts, f"{workdir}/current/MANIFEST.json") is not None

    run_id = ct_readlink(hosts, f"{workdir}/runs/latest")
    assert run_id and run_id.endswith("-selftest"), run_id
    assert run_id in started.stdout
    run_dir = f"{workdir}/runs/{run_id}"
    assert ct_read(hosts, f"{run_dir}/run.json") is not None

    live = status_json(fleet, 0)
    assert (live["run_id"], live["release"]) == (run_id, release)
    assert live["alive"] is True and live["state"] not in FINAL_STATES, live

    again = fleet.fab("train")
    assert again.returncode == 5, again.stdout + again.stderr
    assert "fab stop" in one_line_error(again)

    def steps_logged() -> int:
        return (ct_read(hosts, f"{run_dir}/train.log") or "").count("step ")

    wait_for("six step lines in train.log", lambda: steps_logged() >= 6)
    logs = fleet.fab("logs", "-n", "5")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert len(lines) == 5, logs.stdout
    log_text = ct_read(hosts, f"{run_dir}/train.log") or ""
    for line in lines:
        assert line.strip() and line.strip() in log_text, line

    stopped = fleet.fab("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not run_pids(hosts, run_dir)

    final = status_json(fleet, 10)  # fab status exits 10 for a stopped run (fleet/status/model.py)
    assert (final["run_id"], final["state"], final["alive"]) == (run_id, "stopped", False), final
    assert final["process_exit_code"] == 0, final
    events = ct_read(hosts, f"{run_dir}/events.jsonl") or ""
    assert '"stopped"' in events  # the selftest's SIGTERM path: checkpoint, phase stopped

    not_live = fleet.fab("stop")  # nothing live: a no-op (0) or RunError (5), never a traceback
    assert not_live.returncode in (0, 5) and "Traceback" not in not_live.stderr, not_live.stderr


def test_lxc_container_type_through_lxc_attach(remote_fleet: RemoteFleet) -> None:
    """The same container as `{type = "lxc", name = ...}`: lxc-attach on the host, no pct."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    fleet.write(
        container={"type": "lxc", "name": hosts.ct_name},
        run={"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {}},
    )
    deployed = fleet.fab("deploy", "train")
    assert deployed.returncode == 0, deployed.stderr
    release = released(deployed)
    assert ct_readlink(hosts, f"{fleet.workdir}/current") == f"releases/{release}"
    assert status_json(fleet, 0)["alive"] is True
    stopped = fleet.fab("stop")
    assert stopped.returncode == 0, stopped.stderr


# ------------------------------------------------------------------ a deploy cut mid-stream


def test_deploy_cut_mid_stream_keeps_current(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    first = fleet.fab("deploy")
    assert first.returncode == 0, first.stderr
    release = released(first)
    before = tree_digest(hosts, f"{workdir}/releases/{release}")

    flag = tmp_path / "cut"
    wrapper = tmp_path / "pct"  # -> tests/hosts/cutting-pct, configured by pct.json next to it
    wrapper.symlink_to(Path(hosts.pct).with_name("cutting-pct"))
    listener = int(Path(hosts.sshd_pidfile).read_text())
    config = {"real": hosts.pct, "cut_at": 16384, "listener": listener, "flag": str(flag)}
    wrapper.with_name("pct.json").write_text(json.dumps(config))
    fleet.write(commands={**fleet.defaults["commands"], "pct": str(wrapper)})

    cut = fleet.fab("deploy", timeout=120)
    assert flag.exists(), "the upload never reached the wrapper"
    sent, more = map(int, flag.read_text().split())
    assert (sent, more) == (16384, 1), "the tar stream was not longer than the cut: not cut mid-stream"
    assert cut.returncode in (3, 4), cut.stdout + cut.stderr
    one_line_error(cut)

    # The previous release is still current and byte-for-byte intact.
    fleet.write(commands=fleet.defaults["commands"])
    assert ct_readlink(hosts, f"{workdir}/current") == f"releases/{release}"
    assert tree_digest(hosts, f"{workdir}/releases/{release}") == before
    partial = [name for name in ct_listdir(hosts, f"{workdir}/releases") if name.startswith(".")]
    assert partial, "the cut upload left no partial tree: was anything extracted before the cut?"

    # The next deploy works and clears what the cut one left behind.
    second = fleet.fab("deploy")
    assert second.returncode == 0, second.stderr
    assert ct_readlink(hosts, f"{workdir}/current") == f"releases/{released(second)}"
    leftovers = [name for name in ct_listdir(hosts, f"{workdir}/releases") if name.startswith(".")]
    assert leftovers == []


# ------------------------------------------------------------------ hostile inventory values


def hostile(marker: str) -> str:
    """A value that would create /tmp/<marker> if any shell layer evaluated it."""
    return f"a b;touch /tmp/{marker};$(touch /tmp/{marker})`touch /tmp/{marker}`'\"x\" 'y"


def test_hostile_workdir_is_rejected_or_literal(remote_fleet: RemoteFleet) -> None:
    fleet, hosts = remote_fleet, remote_fleet.hosts
    marker = f"fleet-marker-{uuid.uuid4().hex[:8]}"
    workdir = f"{fleet.workdir}/{hostile(marker)}"
    fleet.write(workdir=workdir)
    result = fleet.fab("deploy")
    if result.returncode == 0:
        release = released(result)
        assert ct_readlink(hosts, f"{workdir}/current") == f"releases/{release}"
    else:
        assert result.returncode == 2, result.stdout + result.stderr
        assert "workdir" in one_line_error(result)
    markers_absent(hosts, marker)


def test_hostile_run_overrides_and_env_are_literal_and_env_not_logged(remote_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    marker = f"fleet-marker-{uuid.uuid4().hex[:8]}"
    override = f"--other.note={hostile(marker)}"
    secret = f"s3cret {hostile(marker)}"
    fleet.write(
        run={
            "module": "training.selftest",
            "config": "selftest",
            "overrides": [*LONG_RUN, override],
            "env": {"FLEET_TEST_SECRET": secret},
        }
    )
    started = fleet.fab("deploy", "train")
    if started.returncode == 2:  # rejected by validation: acceptable, nothing may have run
        one_line_error(started)
        markers_absent(hosts, marker)
        return
    assert started.returncode == 0, started.stderr
    run_dir = f"{workdir}/runs/{ct_readlink(hosts, f'{workdir}/runs/latest')}"

    # The override reached the trainer as one literal argv element (it echoes ignored overrides).
    wait_for("the selftest to start", lambda: "step " in (ct_read(hosts, f"{run_dir}/train.log") or ""))
    assert override in (ct_read(hosts, f"{run_dir}/train.log") or "")
    # The env value reached the process literally (read from /proc of the run, host view).
    pids = run_pids(hosts, run_dir)
    assert pids, "the run's process was not found"
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    assert f"FLEET_TEST_SECRET={secret}".encode() in environ
    markers_absent(hosts, marker)

    # The secret is never logged: not by fab, not in run.json, not in the run's log.
    status = fleet.fab("status")
    shown = fleet.fab("status", "--json")
    for text in (started.stdout, started.stderr, status.stdout, status.stderr, shown.stdout, shown.stderr):
        assert "s3cret" not in text
    assert "s3cret" not in (ct_read(hosts, f"{run_dir}/run.json") or "")
    assert "s3cret" not in (ct_read(hosts, f"{run_dir}/train.log") or "")
    assert fleet.fab("stop").returncode == 0


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param(lambda m: {"container": {"type": "lxc", "name": hostile(m)}}, id="lxc-name"),
        pytest.param(lambda m: {"container": {"type": "pct", "id": f"200;touch /tmp/{m}"}}, id="pct-id"),
        pytest.param(lambda m: {"host": f"root@127.0.0.1;touch /tmp/{m}:2222"}, id="host"),
        pytest.param(lambda m: {"env": hostile(m)}, id="env-name"),
    ],
)
def test_hostile_names_are_rejected(remote_fleet: RemoteFleet, changes: Callable[[str], dict]) -> None:
    marker = f"fleet-marker-{uuid.uuid4().hex[:8]}"
    remote_fleet.write(**changes(marker))
    result = remote_fleet.fab("deploy", "train")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "targets.ct200" in one_line_error(result)
    markers_absent(remote_fleet.hosts, marker)


def test_hostile_run_module_is_rejected_or_literal(remote_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    marker = f"fleet-marker-{uuid.uuid4().hex[:8]}"
    fleet.write(run={"module": f"training.selftest;touch /tmp/{marker}", "config": "selftest"})
    result = fleet.fab("deploy", "train")
    if result.returncode == 2:
        assert "targets.ct200.run" in one_line_error(result)
    else:
        assert result.returncode == 0, result.stderr
        # Passed literally, python3 finds no such module and the run exits non-zero.
        testkit.wait_status(
            fleet, lambda: status_json(fleet), lambda st: st["state"] in FINAL_STATES, "the run to exit"
        )
        run_dir = f"{workdir}/runs/{ct_readlink(hosts, f'{workdir}/runs/latest')}"
        assert "No module named" in (ct_read(hosts, f"{run_dir}/train.log") or "")
    markers_absent(hosts, marker)


# ------------------------------------------------------------------ host keys, reachability


def test_unknown_host_key_with_strict_policy_is_refused(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    fleet.write(known_hosts=fleet.hosts.known_hosts_empty)
    result = fleet.fab("status")
    assert result.returncode == 3, result.stdout + result.stderr
    line = one_line_error(result)
    assert "127.0.0.1" in line and "known" in line.lower(), line


def test_changed_host_key_is_refused_even_with_accept_new(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    for policy in ("strict", "accept-new"):
        fleet.write(known_hosts=fleet.hosts.known_hosts_wrong, host_key_policy=policy)
        result = fleet.fab("status")
        assert result.returncode == 3, f"{policy}: {result.stdout}{result.stderr}"
        one_line_error(result)


def test_accept_new_accepts_an_unknown_host(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    fleet = remote_fleet
    known = tmp_path / "known_hosts"
    shutil.copy(fleet.hosts.known_hosts_empty, known)
    fleet.write(known_hosts=str(known), host_key_policy="accept-new")
    result = fleet.fab("deploy")
    assert result.returncode == 0, result.stderr


def test_unreachable_host_and_bad_key_are_one_line_exit_3(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    fleet.write(host="root@127.0.0.1:1")
    closed = fleet.fab("status", timeout=120)
    assert closed.returncode == 3, closed.stdout + closed.stderr
    one_line_error(closed)
    fleet.write(
        host=fleet.hosts.host, identity_file=str(Path(fleet.hosts.known_hosts).parent / "other_host_key")
    )
    denied = fleet.fab("status", timeout=120)
    assert denied.returncode == 3, denied.stdout + denied.stderr
    one_line_error(denied)


def test_stopped_container_says_what_pct_status_says(remote_fleet: RemoteFleet) -> None:
    fleet, hosts = remote_fleet, remote_fleet.hosts
    fleet.write(container={"type": "pct", "id": hosts.stopped_ct_id})
    for task in ("deploy", "status"):
        result = fleet.fab(task)
        assert result.returncode == 3, f"{task}: {result.stdout}{result.stderr}"
        line = one_line_error(result)
        assert "status: stopped" in line and "pct start" in line, line
    fleet.write(container={"type": "pct", "id": 999})  # no such container on the host
    missing = fleet.fab("deploy")
    assert missing.returncode == 3, missing.stdout + missing.stderr
    line = one_line_error(missing)
    assert "999.conf' does not exist" in line and "targets.ct200.container" in line, line


# ------------------------------------------------------------------ several targets, follow


def test_all_targets_read_only_in_parallel(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    """FLEET_TARGET=all: logs of every target; a target whose container is down fails on its own line."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    fleet.write(run={"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {}})
    started = fleet.fab("deploy", "train")
    assert started.returncode == 0, started.stderr
    run_dir = f"{fleet.workdir}/runs/{ct_readlink(hosts, f'{fleet.workdir}/runs/latest')}"
    wait_for("step lines in train.log", lambda: "step " in (ct_read(hosts, f"{run_dir}/train.log") or ""))
    down = {**fleet.target, "container": {"type": "pct", "id": hosts.stopped_ct_id}}
    config = tmp_path / "two.toml"
    config.write_text(helpers_module(fleet).render_inventory({"ct200": fleet.target, "down": down}, "ct200"))
    env = {"FLEET_TARGET": "all"}

    logs = helpers_module(fleet).fab("logs", "-n", "2", config=config, env=env)
    assert logs.returncode == 3, logs.stdout + logs.stderr
    assert "== ct200 " in logs.stdout and "step " in logs.stdout, logs.stdout
    assert "Traceback" not in logs.stderr
    errors = [line for line in logs.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "down" in errors[0] and "status: stopped" in errors[0], logs.stderr

    refused = helpers_module(fleet).fab("deploy", config=config, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "FLEET_TARGET=all" in one_line_error(refused)
    assert fleet.fab("stop").returncode == 0


def test_logs_follow_streams_and_stops_on_ctrl_c(remote_fleet: RemoteFleet) -> None:
    fleet, hosts = remote_fleet, remote_fleet.hosts
    fleet.write(run={"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {}})
    assert fleet.fab("deploy", "train").returncode == 0
    log = f"{fleet.workdir}/runs/{ct_readlink(hosts, f'{fleet.workdir}/runs/latest')}/train.log"
    follow = helpers_module(fleet).fab_popen(
        "logs", "-n", "1", "--follow", config=fleet.config, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=testkit.ctrl_c_reaches_it,
    )  # fmt: skip
    try:
        seen = read_lines(follow, 3)  # new lines keep arriving
        assert all(line.startswith(("step ", "Checkpoint ")) for line in seen), seen
        follow.send_signal(signal.SIGINT)
        follow.wait(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode in (0, 130), follow.stderr.read()
    assert "Traceback" not in follow.stderr.read()

    def tails_left() -> list[int]:
        return [pid for pid, argv in processes() if argv[0].endswith(b"tail") and log.encode() in argv]

    wait_for("the remote `tail -F` to end after the SSH session closed", lambda: not tails_left())
    assert fleet.fab("stop").returncode == 0


def read_lines(proc: subprocess.Popen[str], count: int, timeout: float = 60.0) -> list[str]:
    """``count`` lines of ``proc``'s stdout, failing (not hanging) when they do not come."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < count:
            if not selector.select(timeout=max(deadline - time.monotonic(), 0)):
                pytest.fail(f"gave up waiting for {count} lines of output; got {lines}")
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"output ended after {lines}")
            lines.append(line)
    return lines


def helpers_module(fleet: RemoteFleet) -> ModuleType:
    """tests/conftest.py as pytest loaded it (the module RemoteFleet comes from)."""
    return sys.modules[type(fleet).__module__]


def processes() -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of every process on this machine (containers included)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                found.append((int(proc.name), (proc / "cmdline").read_bytes().split(b"\0")))
            except OSError:
                continue
    return found


# ------------------------------------------------------------------ environment of the run


@pytest.mark.parametrize("mode", ["pct-pve9", "pct-pve8", "lxc"])
def test_run_environment_does_not_inherit_the_ssh_session(
    remote_fleet: RemoteFleet, tmp_path: Path, mode: str
) -> None:
    """The run's environment is what fleet passes, whatever pct's keep-env default (PVE 8: keep).

    PVE 8's `pct exec` and plain `lxc-attach` keep the caller's environment: the SSH session's
    SSH_CONNECTION, the host's PATH, ... A run must not depend on that default (DESIGN: "explicit
    env, never pct's keep-env").
    """
    fleet, hosts = remote_fleet, remote_fleet.hosts
    changes: dict[str, Any] = {
        "run": {"module": "training.selftest", "config": "selftest", "overrides": LONG_RUN, "env": {"K": "v"}}
    }
    if mode == "pct-pve8":
        pve8 = tmp_path / "pct-pve8"  # the shim keeps the environment when called by this name
        pve8.symlink_to(hosts.pct)
        changes["commands"] = {**fleet.defaults["commands"], "pct": str(pve8)}
    elif mode == "lxc":
        changes["container"] = {"type": "lxc", "name": hosts.ct_name}
    fleet.write(**changes)
    started = fleet.fab("deploy", "train")
    assert started.returncode == 0, started.stderr
    run_dir = f"{fleet.workdir}/runs/{ct_readlink(hosts, f'{fleet.workdir}/runs/latest')}"
    wait_for("the run's process", lambda: bool(run_pids(hosts, run_dir)))
    environ = dict(
        item.split(b"=", 1)
        for item in Path(f"/proc/{run_pids(hosts, run_dir)[0]}/environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    assert environ.get(b"K") == b"v"
    leaked = sorted(key.decode() for key in environ if key.startswith((b"SSH_", b"PYENV")))
    assert not leaked, f"{mode}: the run inherited the SSH session's environment: {leaked}"
    assert fleet.fab("stop").returncode == 0


def test_export_over_ssh_brings_the_folder_back_byte_for_byte(
    remote_fleet: RemoteFleet, tmp_path: Path
) -> None:
    """`fab export --to` through SSH + pct: the export command gets the run dir and its output
    folder as literal arguments and the run's environment on stdin, and the folder (binary
    weights included) arrives intact. The container has no torch, so `commands.python` is a
    stand-in for the trainer's `export` that writes a folder as the trainer does (the trainer's
    side runs for real in tests/fleet/test_fab_export.py and tests/training/test_export.py)."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    assert fleet.fab("deploy").returncode == 0
    selftest = fleet.fab("export")  # the fixture's run.module is training.selftest
    assert selftest.returncode == 5 and "not the bundled trainer" in one_line_error(selftest)
    fleet.write(run={"module": "training", "config": "tiny-cpu", "overrides": [], "env": {}})
    none = fleet.fab("export")
    assert none.returncode == 5 and "no run to export" in one_line_error(none)
    fleet.write(run={"module": "training.selftest", "config": "selftest", "overrides": [], "env": {}})
    assert fleet.fab("train", "--no-warm").returncode == 0
    testkit.wait_status(
        fleet, lambda: status_json(fleet), lambda st: st["state"] in FINAL_STATES, "the run to end"
    )

    weights = bytes(range(256)) * 64 + b"\n\r\x00 tail"  # every byte value, newlines, NUL
    label = Path(fleet.workdir).name
    hosts.ct_path(f"/tmp/{label}-weights").write_bytes(weights)
    stand_in = f"/tmp/{label}-python"
    hosts.ct_path(stand_in).write_text(
        "#!/bin/sh\n"
        '[ "$1 $2 $3" = "-m training export" ] || exit 9\n'
        "run_dir=$5 out=$7\n"
        '[ -f "$run_dir/run.json" ] || { echo "error: $run_dir is not a run dir" >&2; exit 2; }\n'
        'mkdir -p "$out" && printf \'{"architectures": ["DFlashDraftModel"], "seen": "%s"}\\n\' '
        '"$FLEET_TEST_EXPORT_ENV" > "$out/config.json"\n'
        f'cp /tmp/{label}-weights "$out/model.safetensors"\n'
        'echo "exported step 42 (25 tensors, bfloat16, mask_token_id 3) -> $out"\n'
    )
    hosts.ct_path(stand_in).chmod(0o755)
    fleet.write(
        run={
            "module": "training",
            "config": "tiny-cpu",
            "overrides": [],
            "env": {"FLEET_TEST_EXPORT_ENV": "on"},
        },
        commands={**fleet.defaults["commands"], "python": stand_in},
    )
    local = tmp_path / "drafter"
    done = fleet.fab("export", "--to", str(local))
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = status_json(fleet)["run_id"]
    assert (
        f"run {run_id} step 42 exported" in done.stdout
        and f"{fleet.workdir}/runs/{run_id}/export" in done.stdout
    )
    assert (local / "model.safetensors").read_bytes() == weights
    assert json.loads((local / "config.json").read_text())["seen"] == "on"  # the run's env, via stdin
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    again = fleet.fab("export", "--to", str(local))  # replaces the local copy whole
    assert again.returncode == 0 and not [p for p in tmp_path.iterdir() if p.name.startswith(".drafter")]
