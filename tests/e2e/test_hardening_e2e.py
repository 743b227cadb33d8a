"""fleet as an attacker or a careless user meets it, through the real `fab` on the real test host
(SSH to 127.0.0.1 -> pct shim -> LXC container 200): secrets, odd inputs, concurrent deploys,
failures that must be named for what they are.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
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
RELEASE_RE = re.compile(r"release (\d{8}T\d{6}Z-[0-9a-f]{7}(?:-dirty)?) is current")
FINAL = ("finished", "stopped", "failed")


# ------------------------------------------------------------------ helpers


def ct_read(hosts: TestHost, path: str) -> str | None:
    result = hosts.pct_exec("cat", "--", path, check=False)
    return result.stdout if result.returncode == 0 else None


def ct_readlink(hosts: TestHost, path: str) -> str | None:
    result = hosts.pct_exec("readlink", "--", path, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def ct_ls(hosts: TestHost, path: str) -> list[str]:
    result = hosts.pct_exec("ls", "-A", "--", path, check=False)
    return result.stdout.split() if result.returncode == 0 else []


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    return lines[0]


def status_json(fleet: RemoteFleet) -> dict[str, Any]:
    result = fleet.fab("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def final(data: dict[str, Any]) -> bool:
    return data["state"] in FINAL


def ended(data: dict[str, Any]) -> bool:
    """Finished, and the process gone with its exit status recorded (it comes after the done event)."""
    return data["state"] == "finished" and data.get("process_exit_code") is not None


def run_selftest(fleet: RemoteFleet, overrides: list[str], env: dict[str, str] | None = None) -> None:
    fleet.write(
        run={"module": "training.selftest", "config": "selftest", "overrides": overrides, "env": env or {}}
    )


def latest_run_dir(fleet: RemoteFleet) -> str:
    return f"{fleet.workdir}/runs/{ct_readlink(fleet.hosts, f'{fleet.workdir}/runs/latest')}"


def selftest_pids(run_dir: str) -> list[int]:
    """Host-view PIDs of the selftest's python processes whose command line names ``run_dir``."""
    found = []
    for pid, argv in processes():
        is_python = b"python" in argv[0].rsplit(b"/", 1)[-1]
        if is_python and b"training.selftest" in argv and any(run_dir.encode() in a for a in argv):
            found.append(pid)
    return found


def processes() -> list[tuple[int, list[bytes]]]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                found.append((int(proc.name), (proc / "cmdline").read_bytes().split(b"\0")))
            except OSError:
                continue
    return found


@pytest.fixture(autouse=True)
def _cleanup(remote_fleet: RemoteFleet) -> Iterator[None]:
    """Remove what a test put next to the fixture's tmux wrapper and the plots of target ct200."""
    yield
    tmux = remote_fleet.target["commands"]["tmux"]
    base = Path(remote_fleet.hosts.ct_path(tmux)).name.removesuffix("-tmux")
    for leftover in Path(remote_fleet.hosts.ct_path("/tmp")).glob(f"{base}-*"):
        if leftover.name != f"{base}-tmux":  # the fixture's own, removed by it
            leftover.unlink(missing_ok=True)
    for png in (testkit.REPO / ".fleet" / "plots").glob("ct200-*.png"):
        png.unlink(missing_ok=True)


@pytest.fixture
def ct_tmpfs(remote_fleet: RemoteFleet) -> Iterator[Any]:
    """``mount(size)``: a small tmpfs inside container 200 (a disk that fills); unmounted after."""
    hosts = remote_fleet.hosts
    mounted: list[str] = []

    def mount(size: str) -> str:
        path = f"{remote_fleet.workdir}-disk{len(mounted)}"
        hosts.pct_exec("mkdir", "-p", "--", path)
        hosts.pct_exec("mount", "-t", "tmpfs", "-o", f"size={size}", "fleet-test-disk", path)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        testkit.kill_processes_naming(path)
        hosts.pct_exec("umount", "-l", "--", path, check=False)
        hosts.pct_exec("rm", "-rf", "--", path, check=False)


# ------------------------------------------------------------------ secrets


class PsSampler:
    """Samples `ps` on the host and in the container while tasks run; keeps every line it saw."""

    def __init__(self, hosts: TestHost) -> None:
        self.hosts = hosts
        self.host_lines: list[str] = []
        self.ct_lines: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._host_ps, 0.05), daemon=True),
            threading.Thread(target=self._loop, args=(self._ct_ps, 0.2), daemon=True),
        ]

    def _host_ps(self) -> None:
        out = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True, check=False)
        self.host_lines.extend(out.stdout.splitlines())

    def _ct_ps(self) -> None:
        out = self.hosts.pct_exec("ps", "-eww", "-o", "args=", check=False)
        self.ct_lines.extend(out.stdout.splitlines())

    def _loop(self, sample: Any, pause: float) -> None:
        while not self._stop.is_set():
            sample()
            time.sleep(pause)

    def __enter__(self) -> PsSampler:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.host_lines)


def files_containing(
    root: Path, needle: bytes, skip: tuple[Path, ...] = (), changed_since: float | None = None
) -> list[str]:
    """Regular files under ``root`` holding ``needle`` (links not followed; /proc /sys /dev /usr skipped).

    ``changed_since``: only files whose inode changed at or after this time are read. A needle made
    at that time can be in no other file: writing a file, linking it or setting its mtime back all
    set its ctime to now, which no process can set back. The container keeps the suite's uv cache
    and the multi-host envs (~15 GB of torch) that would otherwise be read on every run."""
    hits = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in ("proc", "sys", "dev", "usr")]
        for name in filenames:
            path = here / name
            if path in skip or path.is_symlink() or not path.is_file():
                continue
            try:
                if changed_since is not None and path.stat().st_ctime < changed_since:
                    continue
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_run_env_secret_never_in_ps_files_or_tmux(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    """Every task that takes the run's environment (train, warm, plan, doctor), and the read-only ones
    around them: the secret of run.env never shows in `ps` (host and container, sampled while the
    tasks run), in tmux's environment, in the run dir or any file fleet writes, or in fab's output.
    It does reach the processes (a hash of it proves that)."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    marker = uuid.uuid4().hex
    secret = f"tok'{marker} $(x) z"
    digest = hashlib.sha256(secret.encode()).hexdigest()[:16]
    label = Path(fleet.target["commands"]["tmux"]).name.removesuffix("-tmux")
    # commands.python: a wrapper that records a hash of the secret it got, then waits a moment
    # (so `ps` is sampled while the task's command is up) and runs the real python3.
    python = f"/tmp/{label}-python"
    seen = f"/tmp/{label}-env-seen"
    hosts.ct_path(python).write_text(
        "#!/bin/sh\n"
        'hash=$(printf %s "$FLEET_TEST_SECRET" | sha256sum | cut -c1-16)\n'
        'case "$1" in -m) tag="$1$2$3" ;; *) tag="$1$2" ;; esac\n'  # -mtrainingwarm, -I-c (doctor)
        f'printf \'%s %s\\n\' "$tag" "$hash" >> {seen}\n'
        "sleep 2\n"
        'exec python3 "$@"\n'
    )
    hosts.ct_path(python).chmod(0o755)
    commands = {**fleet.defaults["commands"], "python": python}
    env = {"FLEET_TEST_SECRET": secret}
    outputs: list[subprocess.CompletedProcess[str]] = []
    start = time.time()
    with PsSampler(hosts) as ps:
        fleet.write(commands=commands)
        run_selftest(fleet, LONG_RUN, env)
        outputs.append(fleet.fab("deploy", "train", "--no-warm"))
        assert outputs[-1].returncode == 0, outputs[-1].stderr
        run_dir = latest_run_dir(fleet)
        wait_for("the run's steps", lambda: "step " in (ct_read(hosts, f"{run_dir}/train.log") or ""))
        for task in (["status"], ["status", "--json"], ["logs", "-n", "3"], ["plot"], ["gpus"]):
            outputs.append(fleet.fab(*task))
        tmux = fleet.target["commands"]["tmux"]
        tmux_env = hosts.pct_exec(tmux, "show-environment", "-g", check=False).stdout
        tmux_env += hosts.pct_exec(tmux, "show-environment", "-t", "fleet-run", check=False).stdout
        outputs.append(fleet.fab("stop"))
        # warm and plan need the bundled trainer's module; torch is absent in the container, so they
        # fail after their command ran (with the secret in its environment): a one-line error.
        fleet.write(run={"module": "training", "config": "tiny-cpu", "overrides": [], "env": env})
        outputs.append(fleet.fab("warm"))
        outputs.append(fleet.fab("plan"))
        outputs.append(fleet.fab("doctor", "--bandwidth"))  # its send/recv probe runs with run.env
    # The processes got the secret (their hash of it matches) ...
    got = (ct_read(hosts, seen) or "").splitlines()
    assert any(line.startswith("-mtraining.selftesttrain") and line.endswith(digest) for line in got), got
    assert any(line.startswith("-mtrainingwarm") and line.endswith(digest) for line in got), got
    assert any(line.startswith("-mtrainingplan") and line.endswith(digest) for line in got), got
    assert any(line.startswith("-I-") and line.endswith(digest) for line in got), got  # doctor's probe
    # ... while the sampler watched them (their command lines are in what `ps` showed) ...
    assert ps.saw("training.selftest") and ps.saw("training warm") and ps.saw("training plan")
    # ... and the secret was nowhere.
    assert not [line for line in ps.host_lines if marker in line], "host ps showed the secret"
    assert not [line for line in ps.ct_lines if marker in line], "container ps showed the secret"
    assert marker not in tmux_env
    for result in outputs:
        assert marker not in result.stdout + result.stderr
    leaks = files_containing(Path(hosts.ct_rootfs), marker.encode(), changed_since=start - 1)
    assert not leaks, f"files in the container hold the secret: {leaks}"
    controller = files_containing(tmp_path, marker.encode(), skip=(fleet.config,))
    controller += files_containing(testkit.REPO / ".fleet", marker.encode())
    recent = [p for p in Path("/tmp").glob("*") if p.is_file() and p.stat().st_mtime >= start]
    controller += [str(p) for p in recent if p != fleet.config and marker.encode() in p.read_bytes()]
    assert not controller, f"files on this machine hold the secret: {controller}"
    assert ps.saw("fleet-with-env")  # warm, plan, doctor: each through its environment-on-stdin wrapper
    warm, plan = outputs[-3:-1]
    assert warm.returncode == 5 and plan.returncode == 5, warm.stderr + plan.stderr
    # warm streams its command's output (progress), then says in one line what went wrong
    assert warm.stderr.splitlines()[-1].startswith("fleet: ct200: compile-cache warm-up failed (ModuleNot")
    assert "No module named 'torch'" in one_line_error(plan)


def test_failed_launch_leaves_no_run_env_and_latest_unchanged(remote_fleet: RemoteFleet) -> None:
    """tmux cannot start the run: the launch leaves no run.env (secret) and no run behind;
    runs/latest still names the previous run, whose status is unchanged."""
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    run_selftest(fleet, SHORT_RUN, {"FLEET_TEST_SECRET": "launch-secret-value"})
    first = fleet.fab("deploy", "train", "--no-warm")
    assert first.returncode == 0, first.stderr
    previous = ct_readlink(hosts, f"{workdir}/runs/latest")
    testkit.wait_status(fleet, lambda: status_json(fleet), ended, "the first run to end")

    tmux = fleet.target["commands"]["tmux"]
    broken = f"{tmux}-broken"  # the real tmux, except that it cannot create a session
    hosts.ct_path(broken).write_text(
        "#!/bin/sh\n"
        'case "$*" in *new-session*) echo "create session failed: fleet test" >&2; exit 1 ;; esac\n'
        f'exec {tmux} "$@"\n'
    )
    hosts.ct_path(broken).chmod(0o755)
    fleet.write(commands={**fleet.defaults["commands"], "tmux": broken})
    failed = fleet.fab("train", "--no-warm")
    assert failed.returncode == 5, failed.stdout + failed.stderr
    line = one_line_error(failed)
    assert "could not start run" in line and "create session failed" in line, line

    found = hosts.pct_exec("find", workdir, "-name", "run.env", check=False).stdout.split()
    assert found == [], f"run.env left on the target: {found}"
    assert ct_readlink(hosts, f"{workdir}/runs/latest") == previous
    assert ct_ls(hosts, f"{workdir}/runs") == sorted(["latest", previous or ""]), "a never-started run dir"
    fleet.write(commands=fleet.defaults["commands"])
    after = status_json(fleet)
    assert (after["run_id"], after["state"], after["process_exit_code"]) == (previous, "finished", 0), after


# ------------------------------------------------------------------ SSH: known_hosts, identity


def test_known_hosts_with_openssh_features(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    """Comments, @cert-authority for other hosts, wildcard patterns and hashed entries are read as
    ssh reads them; a host vouched for only by a CA line, or revoked, is refused in one line."""
    fleet, hosts = remote_fleet, remote_fleet.hosts
    state = Path(hosts.known_hosts).parent
    host_key = " ".join((state / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    other_key = " ".join((state / "other_host_key.pub").read_text().split()[:2])
    port = hosts.ssh_port

    def try_with(text: str, *, hashed: bool = False) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"known_hosts-{uuid.uuid4().hex[:6]}"
        path.write_text(text)
        if hashed:
            subprocess.run(["ssh-keygen", "-H", "-f", str(path)], capture_output=True, check=True)
            assert "|1|" in path.read_text()
        fleet.write(known_hosts=str(path))
        return fleet.fab("status", "--json")

    mixed = (
        "# fleet's test host\n"
        f"@cert-authority *.example.com {other_key}\n"
        f"!10.0.0.1,[127.0.0.*]:{port}   {host_key}   a comment\n"
        f"pve.example.com {other_key}\n"
    )
    ok = try_with(mixed)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["state"] == "never"
    hashed = try_with(f"[127.0.0.1]:{port} {host_key}\n", hashed=True)
    assert hashed.returncode == 0, hashed.stdout + hashed.stderr

    ca_only = try_with(f"@cert-authority [127.0.0.1]:{port} {other_key}\n")
    assert ca_only.returncode == 3, ca_only.stdout + ca_only.stderr
    line = one_line_error(ca_only)
    assert "line 1" in line and "@cert-authority" in line, line

    revoked = try_with(f"[127.0.0.1]:{port} {host_key}\n@revoked * {host_key}\n")
    assert revoked.returncode == 3, revoked.stdout + revoked.stderr
    line = one_line_error(revoked)
    assert "revoked" in line and "line 2" in line, line

    negated = try_with(f"![127.0.0.1]:{port},[127.0.0.*]:{port} {host_key}\n")  # the only line does not apply
    assert negated.returncode == 3 and "not in" in one_line_error(negated), negated.stderr

    wrong = try_with(f"# only a wrong key\n[127.0.0.*]:{port} {other_key}\n")
    assert wrong.returncode == 3, wrong.stdout + wrong.stderr
    assert "does not match" in one_line_error(wrong)


def test_missing_identity_file_is_named(remote_fleet: RemoteFleet, tmp_path: Path) -> None:
    fleet = remote_fleet
    fleet.write(identity_file=str(tmp_path / "no-such-key"))
    result = fleet.fab("status")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "identity_file" in line and "no such file" in line and "host is up" not in line, line


def test_nul_byte_in_an_override_or_env_is_refused_before_anything_runs(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    run_selftest(fleet, ["--selftest.steps=3\0x"])
    result = fleet.fab("deploy", "train")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "overrides[0]" in line and "NUL" in line and "network" not in line, line
    run_selftest(fleet, [], {"TOKEN": "sec\0ret-value"})
    result = fleet.fab("deploy", "train")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "run.env.TOKEN" in line and "NUL" in line and "ret-value" not in line, line
    assert ct_ls(fleet.hosts, fleet.workdir) == [], "something ran on the target"


# ------------------------------------------------------------------ full disks, killed runs


def test_full_disk_while_pushing_uv_is_named(remote_fleet: RemoteFleet, ct_tmpfs: Any) -> None:
    fleet = remote_fleet
    disk = ct_tmpfs("4m")  # uv is tens of MB
    fleet.write(workdir=f"{disk}/fleet", env="smoke", commands={**fleet.defaults["commands"], "uv": "/no/uv"})
    result = fleet.fab("deploy", timeout=300)
    assert result.returncode == 3, result.stdout + result.stderr
    line = one_line_error(result)
    assert line.startswith("fleet: ct200: no space left on device on "), line
    assert "fleet-put-tar" in line and f"df -h {disk}/fleet" in line, line
    assert "sh -c" not in line and "pct exec" not in line and "PATH=" not in line, line


def test_full_disk_during_a_run_is_diagnosed(remote_fleet: RemoteFleet, ct_tmpfs: Any) -> None:
    fleet = remote_fleet
    disk = ct_tmpfs("8m")
    fleet.write(workdir=f"{disk}/fleet")
    fleet.workdir = f"{disk}/fleet"
    big = ["--selftest.steps=4", "--selftest.step_seconds=0.05", "--selftest.checkpoint_every=2"]
    run_selftest(fleet, [*big, "--selftest.checkpoint_bytes=64000000"])
    started = fleet.fab("deploy", "train", "--no-warm")
    assert started.returncode == 0, started.stdout + started.stderr
    st = testkit.wait_status(fleet, lambda: status_json(fleet), final, "the run to end", timeout=120)
    assert st["state"] == "failed" and st["process_exit_code"] == 1, st
    assert [d["signature"] for d in st["diagnosis"]] == ["disk-full"], st["diagnosis"]
    assert "No space left on device" in st["diagnosis"][0]["cause"] + st["diagnosis"][0]["evidence"]


def test_sigkill_is_diagnosed_with_its_likely_causes(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    run_selftest(fleet, LONG_RUN)
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    run_dir = latest_run_dir(fleet)
    wait_for("the selftest process", lambda: bool(selftest_pids(run_dir)))
    for pid in selftest_pids(run_dir):
        os.kill(pid, 9)  # what the OOM killer does
    st = testkit.wait_status(fleet, lambda: status_json(fleet), final, "the run to end")
    assert (st["state"], st["process_exit_code"]) == ("failed", 137), st
    (diag,) = st["diagnosis"]
    assert diag["signature"] in ("sigkill", "oom-killer"), diag  # oom-killer: the kernel log says so
    if diag["signature"] == "sigkill":
        for cause in ("OOM killer", "fab stop --force", "container"):
            assert cause in diag["cause"], diag
        assert "dmesg" in diag["fix"] or "kernel log" in diag["fix"], diag

    assert fleet.fab("train", "--no-warm").returncode == 0
    wait_for("the second run's process", lambda: bool(selftest_pids(latest_run_dir(fleet))))
    assert fleet.fab("stop", "--force").returncode == 0
    st = status_json(fleet)
    assert (st["state"], st["process_exit_code"]) == ("failed", 137), st
    assert [d["signature"] for d in st["diagnosis"]] == ["sigkill"], st
    assert "fab stop --force" in st["diagnosis"][0]["cause"]


# ------------------------------------------------------------------ output, odd values


def test_status_json_before_any_run_is_an_object_with_a_state(remote_fleet: RemoteFleet) -> None:
    assert remote_fleet.fab("deploy").returncode == 0
    never = remote_fleet.fab("status", "--json")
    assert never.returncode == 0, never.stdout + never.stderr
    data = json.loads(never.stdout)
    assert (data["state"], data["target"], data["run_id"]) == ("never", "ct200", ""), data
    assert "fab train" in data["notes"][0]


def test_stop_into_a_closed_pipe_is_quiet(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    run_selftest(fleet, LONG_RUN)
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    stop = testkit.fab_popen("stop", config=fleet.config, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert stop.stdout is not None and stop.stderr is not None
    stop.stdout.close()  # `fab stop | head -0`: the reader is gone before fab writes a byte
    stderr = stop.stderr.read().decode()
    assert stop.wait(timeout=180) == 141, stderr  # 128 + SIGPIPE, as a shell reports it
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr and not stderr.strip(), stderr
    st = status_json(fleet)
    assert (st["state"], st["process_exit_code"]) == ("stopped", 0), st  # the stop itself was done


@pytest.mark.parametrize(
    "workdir", ["/", "/usr", "/etc", "/usr/local/lib/fleet", "/workspace/../etc", "/root"]
)
def test_workdir_over_system_paths_is_refused(remote_fleet: RemoteFleet, workdir: str) -> None:
    remote_fleet.write(workdir=workdir)
    result = remote_fleet.fab("status")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert "targets.ct200.workdir" in line, line


def test_plot_does_not_dirty_the_checkout(remote_fleet: RemoteFleet) -> None:
    fleet = remote_fleet
    run_selftest(fleet, SHORT_RUN)
    assert fleet.fab("deploy", "train", "--no-warm").returncode == 0
    testkit.wait_status(
        fleet, lambda: status_json(fleet), lambda st: st["state"] == "finished", "the run to finish"
    )

    def git_status() -> str:
        return subprocess.run(
            ["git", "-C", str(testkit.REPO), "status", "--porcelain", "--untracked-files=normal"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    before = git_status()
    plotted = fleet.fab("plot")
    assert plotted.returncode == 0, plotted.stdout + plotted.stderr
    path = Path(plotted.stdout.strip().removeprefix("wrote "))
    try:
        assert path.is_file() and path.stat().st_size > 10_000
        assert git_status() == before, "the plot made the checkout dirty (the next release would be -dirty)"
    finally:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------ concurrent deploys


SLOW_PCT = """#!{python}
# The real pct, except that the release upload (`fleet-put-tar`) waits for a go flag.
import os, sys, time
from pathlib import Path
real, waiting, go = {real!r}, Path({waiting!r}), Path({go!r})
if "fleet-put-tar" in sys.argv:
    waiting.touch()
    deadline = time.monotonic() + 300
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
os.execv(real, [real, *sys.argv[1:]])
"""


def test_concurrent_deploys_get_distinct_ids_and_prune_to_keep(
    remote_fleet: RemoteFleet, tmp_path: Path
) -> None:
    """Two deploys that prepared at once propose the same release id (the newest release on the
    target is from a clock ahead of ours: both bump past it to the same second). The second to
    install gets a new id instead of 'already exists', and exactly keep_releases (3) remain."""
    fleet, hosts, workdir = remote_fleet, remote_fleet.hosts, remote_fleet.workdir
    planted = ["20970101T000000Z-abcdef0", "20980101T000000Z-abcdef0", "20990101T000000Z-abcdef0"]
    for rid in planted:
        hosts.pct_exec("mkdir", "-p", f"{workdir}/releases/{rid}")
    waiting, go = tmp_path / "waiting", tmp_path / "go"
    slow = tmp_path / "slow-pct"
    slow.write_text(SLOW_PCT.format(python=sys.executable, real=hosts.pct, waiting=str(waiting), go=str(go)))
    slow.chmod(0o755)
    second_config = tmp_path / "second.toml"
    fleet.write(commands={**fleet.defaults["commands"], "pct": str(slow)})
    shutil.copy(fleet.config, second_config)
    fleet.write(commands=fleet.defaults["commands"])

    late = testkit.fab_popen(
        "deploy", config=second_config, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for("the late deploy to reach its upload", waiting.exists, timeout=120)
        early = fleet.fab("deploy")  # prepares after the late one did, installs first
        go.touch()
        out, err = late.communicate(timeout=300)
    finally:
        if late.poll() is None:
            late.kill()
    assert early.returncode == 0, early.stdout + early.stderr
    assert late.returncode == 0, out + err
    first, second = RELEASE_RE.search(early.stdout), RELEASE_RE.search(out)
    assert first and second, (early.stdout, out)
    assert first.group(1).startswith("20990101T000001Z-"), first.group(1)
    assert second.group(1) > first.group(1)  # distinct, and in install order
    assert ct_readlink(hosts, f"{workdir}/current") == f"releases/{second.group(1)}"
    left = sorted(name for name in ct_ls(hosts, f"{workdir}/releases") if not name.startswith("."))
    assert left == sorted([planted[-1], first.group(1), second.group(1)]), left
