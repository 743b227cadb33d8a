"""Shared test helpers, written once: the real test host (sshd + LXC + pct shim), the real `fab`,
a private tmux, `wait_for`, the tiny Qwen3 target and the tiny compile config.

The `hosts` tier needs `tests/hosts/setup` (root) to have run; its facts are read from
`tests/hosts/.state/hosts.env`. Without them the tier is skipped with the reason, unless
`FLEET_TEST_REQUIRE_HOSTS=1` (CI), where a missing host is a failure.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from training.contract import DATA_CACHE_ENV, EXIT_CODE_FILE

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parent.parent
HOSTS_ENV = Path(os.environ.get("FLEET_TEST_HOSTS_ENV") or REPO / "tests" / "hosts" / ".state" / "hosts.env")
FAB = REPO / ".venv" / "bin" / "fab"
SETUP_HINT = "test host not set up: run tests/hosts/setup"
# The suite's longest modules, longest first (worker-seconds in a CI run on a 2-core VM, 2026-12-07:
# the ci-speed branch's whole-suite run of 1,228.5 s, summed from its --durations list, so at least
# that): handed out first after the exclusive-host modules (tests/conftest.py). The multi-host module
# is in no slow tier: unnamed here it would start only after every slow module.
LONGEST_MODULES = (
    "tests/e2e/test_lifecycle_e2e.py",  # 259 s
    "tests/e2e/test_fresh_machine.py",  # 252 s (its container's CPU besides)
    "tests/training/run/test_smol.py",  # 223 s (~185 s after its cuts: still beside the first)
    "tests/e2e/test_multihost_e2e.py",  # 217 s
    "tests/training/test_topology.py",  # 206 s
    "tests/training/compile/test_compile_cache.py",  # 173 s
    "tests/training/run/test_tiny_run.py",  # 98 s
    "tests/fleet/test_fab_phases.py",  # 92 s
)


@dataclass(frozen=True)
class TestHost:
    """The facts of the test host written by tests/hosts/setup."""

    __test__ = False  # not a test class

    ssh_host: str
    ssh_port: int
    ssh_user: str
    identity: str
    known_hosts: str
    known_hosts_wrong: str
    known_hosts_empty: str
    sshd_pidfile: str
    pct: str
    ct_id: int
    ct_name: str
    ct_rootfs: str
    stopped_ct_id: int
    stopped_ct_name: str
    peer_ct_id: int = 0  # a second running container: the other host of a multi-host run
    peer_ct_name: str = ""

    @property
    def host(self) -> str:
        """The inventory `host` value: user@host:port."""
        return f"{self.ssh_user}@{self.ssh_host}:{self.ssh_port}"

    def ct_path(self, path: str) -> Path:
        """Where a path inside the running container is, seen from this machine."""
        return Path(self.ct_rootfs) / path.lstrip("/")

    def pct_exec(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run argv in the container directly through the shim (no SSH): for test set-up and checks."""
        return subprocess.run(
            [self.pct, "exec", str(self.ct_id), "--", *argv],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )


def parse_hosts_env(text: str) -> dict[str, str]:
    """KEY=VALUE lines (values shell-quoted, `#` comments) -> dict."""
    facts: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if sep:
            words = shlex.split(value)
            facts[key.strip()] = words[0] if words else ""
    return facts


def _host_problem() -> str | TestHost:
    """The test host, or why it cannot be used."""
    if not HOSTS_ENV.exists():
        return f"{SETUP_HINT} ({HOSTS_ENV} missing)"
    facts = parse_hosts_env(HOSTS_ENV.read_text())
    try:
        host = TestHost(
            ssh_host=facts["FLEET_TEST_SSH_HOST"],
            ssh_port=int(facts["FLEET_TEST_SSH_PORT"]),
            ssh_user=facts["FLEET_TEST_SSH_USER"],
            identity=facts["FLEET_TEST_IDENTITY"],
            known_hosts=facts["FLEET_TEST_KNOWN_HOSTS"],
            known_hosts_wrong=facts["FLEET_TEST_KNOWN_HOSTS_WRONG"],
            known_hosts_empty=facts["FLEET_TEST_KNOWN_HOSTS_EMPTY"],
            sshd_pidfile=facts["FLEET_TEST_SSHD_PIDFILE"],
            pct=facts["FLEET_TEST_PCT"],
            ct_id=int(facts["FLEET_TEST_CT_ID"]),
            ct_name=facts["FLEET_TEST_CT_NAME"],
            ct_rootfs=facts["FLEET_TEST_CT_ROOTFS"],
            stopped_ct_id=int(facts["FLEET_TEST_STOPPED_CT_ID"]),
            stopped_ct_name=facts["FLEET_TEST_STOPPED_CT_NAME"],
            peer_ct_id=int(facts.get("FLEET_TEST_PEER_CT_ID", "0")),
            peer_ct_name=facts.get("FLEET_TEST_PEER_CT_NAME", ""),
        )
    except (KeyError, ValueError) as err:
        return f"{SETUP_HINT} ({HOSTS_ENV} is incomplete: {err})"
    try:
        os.kill(int(Path(host.sshd_pidfile).read_text().strip()), 0)
    except PermissionError:
        return f"{SETUP_HINT} (its files and sshd belong to root: run the tests as root)"
    except (OSError, ValueError):
        return f"{SETUP_HINT} (the test sshd of {HOSTS_ENV} is not running)"
    state = subprocess.run(
        ["lxc-info", "-n", host.ct_name, "-s", "-H"], capture_output=True, text=True, check=False
    )
    if state.stdout.strip() != "RUNNING":
        return f"{SETUP_HINT} (container {host.ct_name} is not running)"
    return host


@pytest.fixture(scope="session")
def hosts() -> TestHost:
    """The real SSH + LXC test host; skip (or fail when FLEET_TEST_REQUIRE_HOSTS=1) without it."""
    found = _host_problem()
    if isinstance(found, str):
        if os.environ.get("FLEET_TEST_REQUIRE_HOSTS") == "1":
            pytest.fail(found, pytrace=False)
        pytest.skip(found)
    return found


# ------------------------------------------------------------------ fleet.toml + fab


def toml_value(value: Any) -> str:
    """A TOML literal for str / bool / int / float / list / dict (JSON strings are TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return json.dumps(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML literal for {value!r}")


def render_inventory(targets: Mapping[str, Mapping[str, Any]], default_target: str) -> str:
    """An inventory text; each target's dict values become `[targets.NAME.KEY]` tables. A local
    target's runs get the session's tokenized-data cache (tests/conftest.py) unless they name one."""
    lines = [f"default_target = {toml_value(default_target)}", ""]
    shared = os.environ.get(DATA_CACHE_ENV, "")
    for name, spec in targets.items():
        run = spec.get("run")
        if shared and spec.get("host") == "local" and isinstance(run, Mapping):
            spec = {**spec, "run": {**run, "env": {DATA_CACHE_ENV: shared, **run.get("env", {})}}}
        lines.append(f"[targets.{name}]")
        tables = {k: v for k, v in spec.items() if isinstance(v, Mapping) and k != "container"}
        for key, value in spec.items():
            if key not in tables:
                lines.append(f"{key} = {toml_value(value)}")
        for table, values in tables.items():
            lines += ["", f"[targets.{name}.{table}]"]
            lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def ct200_target(hosts: TestHost, workdir: str) -> dict[str, Any]:
    """Target `ct200`: the test host over SSH, container 200 through the pct shim, the selftest run."""
    return {
        "host": hosts.host,
        "identity_file": hosts.identity,
        "host_key_policy": "strict",
        "known_hosts": hosts.known_hosts,
        "container": {"type": "pct", "id": hosts.ct_id},
        "workdir": workdir,
        "gpus": 0,
        "env": "",
        "keep_releases": 3,
        "run": {"module": "training.selftest", "config": "selftest", "overrides": [], "env": {}},
        "commands": {"pct": hosts.pct, "python": "python3"},
    }


@dataclass
class RemoteFleet:
    """A temporary fleet.toml with target `ct200` and the real `fab` run against it."""

    hosts: TestHost
    config: Path
    workdir: str
    target: dict[str, Any]

    @property
    def defaults(self) -> dict[str, Any]:
        """The target as the fixture first wrote it."""
        return self._defaults

    def __post_init__(self) -> None:
        self._defaults = dict(self.target)

    def write(self, **changes: Any) -> Path:
        """Rewrite fleet.toml with target keys changed (a dict value replaces the whole table)."""
        self.target = {**self.target, **changes}
        self.config.write_text(render_inventory({"ct200": self.target}, "ct200"))
        return self.config

    def fab(
        self, *args: str, timeout: float = 180, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `.venv/bin/fab ARGS` with FLEET_CONFIG set; output captured as text."""
        return fab(*args, config=self.config, timeout=timeout, env=env)


def fab_env(config: Path | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment `fab` gets in a test: this one without its FLEET_* (the test runner's own
    FLEET_CONFIG/FLEET_TARGET never leak in), then FLEET_CONFIG=config and ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    full["PYTHONUNBUFFERED"] = "1"
    if config is not None:
        full["FLEET_CONFIG"] = str(config)
    full.update(env or {})
    return full


def fab(
    *args: str,
    config: Path | None,
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
    in_process: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The real `fab ARGS` in the repo root with FLEET_CONFIG=config: exit code, stdout, stderr.

    By default a subprocess (`.venv/bin/fab`, what a user runs). ``in_process=True`` runs the
    same entry point (Fabric's ``program.run``, the console script's body) in this process with
    the same environment, cwd and argv, its output captured: for the many cases that only check
    how a task refuses bad input (a subprocess costs ~1.3 s of start-up each). An exception that
    is not a clean exit becomes exit 1 with its traceback on stderr, as the subprocess would show.
    Nothing that starts processes or needs a timeout belongs in process.
    """
    if not in_process:
        return subprocess.run(
            [str(FAB), *args],
            cwd=REPO,
            env=fab_env(config, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    return _fab_in_process(list(args), fab_env(config, env))


def fab_popen(
    *args: str, config: Path, env: Mapping[str, str] | None = None, **popen: Any
) -> subprocess.Popen[Any]:
    """The real `fab ARGS` started as :func:`fab` runs it, for a test that reads or signals it."""
    return subprocess.Popen([str(FAB), *args], cwd=REPO, env=fab_env(config, env), **popen)


def _fab_in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    from fabric.main import program

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(REPO)
        sys.argv = [str(FAB), *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                program.run([str(FAB), *args])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
    return subprocess.CompletedProcess([str(FAB), *args], code, out.getvalue(), err.getvalue())


@contextmanager
def remote_fleet_at(hosts: TestHost, base: Path) -> Iterator[RemoteFleet]:
    """fleet.toml in ``base`` with target `ct200`, a fresh workdir and a private tmux server.

    Several suites (and benchmarks) share container 200; each test's `commands.tmux` is a
    two-line wrapper in the container around the real tmux with its own socket (`tmux -L`),
    so their `fleet-run` sessions never meet. Everything is removed afterwards.
    """
    label = f"fleet-test-{uuid.uuid4().hex[:10]}"
    workdir = f"/workspace/{label}"
    tmux = f"/tmp/{label}-tmux"
    wrapper = hosts.ct_path(tmux)
    wrapper.write_text(f'#!/bin/sh\nexec tmux -L {label} "$@"\n')
    wrapper.chmod(0o755)
    target = ct200_target(hosts, workdir)
    target["commands"] = {**target["commands"], "tmux": tmux}
    fleet = RemoteFleet(hosts, base / "fleet.toml", workdir, target)
    fleet.write()
    try:
        yield fleet
    finally:
        # A run survives its tmux server (run.sh ignores SIGHUP): stop it the fleet way, then kill
        # whatever still names this workdir, then remove its files. Where no run was ever launched
        # (no runs/ in the workdir) there is nothing to stop: a `fab` start-up and an SSH session
        # less for most of the tests that only check a refusal.
        if hosts.ct_path(f"{workdir}/runs").exists():
            fleet.write(**target)
            try:
                fleet.fab("stop", "--force", timeout=60)
            except subprocess.TimeoutExpired:
                pass  # the kill below is the safety net
        hosts.pct_exec("tmux", "-L", label, "kill-server", check=False)
        kill_processes_naming(workdir)
        hosts.pct_exec("rm", "-rf", "--", workdir, tmux, check=False)


@pytest.fixture
def remote_fleet(hosts: TestHost, tmp_path: Path) -> Iterator[RemoteFleet]:
    """A test's own `remote_fleet_at`: fleet.toml in tmp_path, a fresh workdir, removed after."""
    with remote_fleet_at(hosts, tmp_path) as fleet:
        yield fleet


def processes_with(text: str) -> list[int]:
    """Host-view PIDs of the processes (the test containers' included) whose command line holds ``text``."""
    needle = text.encode()
    return [pid for pid, proc in _processes() if needle in _read(proc / "cmdline")]


def kill_processes_naming(text: str) -> list[int]:
    """SIGKILL every process (host view, containers included) whose command line contains ``text``."""
    killed = []
    for pid in processes_with(text):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue  # gone meanwhile, or not ours to signal
    return killed


# ------------------------------------------------------------------ processes the tests start

SESSION_ENV = "PYTEST_FLEET_SESSION"  # not FLEET_*: helpers strip those from what they start
_container_pids_at_start: set[int] = set()


@dataclass(frozen=True)
class Proc:
    """A process on this machine (containers included), as the leak check reports it."""

    pid: int
    argv: str
    where: str  # "this machine" or "container NAME"

    def text(self) -> str:
        return f"PID {self.pid} ({self.where}): {self.argv[:200]}"


def start_session_marker() -> str:
    """Put a per-session marker into this process's environment: every process the tests start
    here inherits it (xdist's workers, fab, tmux servers, runs), so the end of the session can find
    the ones still alive. Kept when already set (a nested pytest belongs to the outer session)."""
    return os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def _test_containers() -> set[str]:
    """The test host's containers the suite uses: 200, 202 and the fresh-machine test's own
    (tests/e2e/test_fresh_machine.py names it `<prefix>fresh`); empty without a test host. Other
    containers of the same prefix (a benchmark's) are not the suite's business."""
    if not HOSTS_ENV.exists():
        return set()
    facts = parse_hosts_env(HOSTS_ENV.read_text())
    name, ct_id = facts.get("FLEET_TEST_CT_NAME", ""), facts.get("FLEET_TEST_CT_ID", "")
    names = {name, facts.get("FLEET_TEST_PEER_CT_NAME", "")}
    if ct_id and name.endswith(f"ct{ct_id}"):
        names.add(f"{name.removesuffix(f'ct{ct_id}')}fresh")
    return {n for n in names if n}


def _processes() -> Iterator[tuple[int, Path]]:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            yield int(proc.name), proc


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _is_zombie(proc: Path) -> bool:
    stat = _read(proc / "stat").decode(errors="replace")
    return ") Z " in stat or not stat


def _container_of(proc: Path, names: set[str]) -> str:
    """The container (one of ``names``) that ``proc`` runs in, or "" (its cgroup names it)."""
    for line in _read(proc / "cgroup").decode(errors="replace").splitlines():
        for part in line.split("/"):
            if part.startswith("lxc.payload.") and part.removeprefix("lxc.payload.") in names:
                return part.removeprefix("lxc.payload.")
    return ""


def container_processes() -> set[int]:
    """PIDs of every process in the test host's containers."""
    names = _test_containers()
    return {pid for pid, proc in _processes() if _container_of(proc, names)} if names else set()


def note_container_processes() -> None:
    """What runs in the test containers before the tests (their init, a sleep): not theirs."""
    _container_pids_at_start.update(container_processes())


def leftovers(grace: float = 15.0) -> list[Proc]:
    """Processes the tests started that are still alive: ones carrying this session's marker in
    their environment, and ones in the test host's containers that were not there at the start.
    Waits up to ``grace`` seconds for processes on their way out."""
    marker = f"{SESSION_ENV}={os.environ.get(SESSION_ENV, '')}\0".encode()
    names = _test_containers()
    mine = ancestors(os.getpid())  # this session and what started it are never leftovers
    deadline = time.monotonic() + grace
    while True:
        found = []
        for pid, proc in _processes():
            if _is_zombie(proc) or pid in mine:
                continue
            where = ""
            if os.environ.get(SESSION_ENV) and marker in _read(proc / "environ"):
                where = "this machine"
            elif names and pid not in _container_pids_at_start and (ct := _container_of(proc, names)):
                where = f"container {ct}"
            if where:
                argv = _read(proc / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(Proc(pid, argv, where))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it (``/proc/N/stat``'s parent field)."""
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        stat = _read(Path(f"/proc/{pid}/stat")).decode(errors="replace")
        try:
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            break
    return found


def kill(procs: Sequence[Proc]) -> None:
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except OSError:
            continue  # gone meanwhile


def descendants(*roots: int) -> set[int]:
    """``roots`` and every process below them (by parent PID), as they are now."""
    children: dict[int, list[int]] = {}
    for pid, proc in _processes():
        stat = _read(proc / "stat").decode(errors="replace")
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def argv_of(pid: int) -> str:
    """The command line of ``pid`` as one string ("" when gone)."""
    return _read(Path(f"/proc/{pid}/cmdline")).replace(b"\0", b" ").decode(errors="replace")


# ------------------------------------------------------------------ the test host, shared


@contextmanager
def test_host_lock(exclusive: bool) -> Iterator[None]:
    """Use of the test host: shared by any number of tests at once, or exclusive (a test that
    changes what the others rely on). Two flock files: ``gate`` gives a waiting exclusive user
    priority (new shared users queue behind it), ``lock`` is the readers-writer lock itself."""
    import fcntl

    folder = HOSTS_ENV.parent if HOSTS_ENV.parent.is_dir() else Path(tempfile.gettempdir())
    with open(folder / "test-host.gate", "a") as gate, open(folder / "test-host.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ------------------------------------------------------------------ local tmux


@dataclass(frozen=True)
class LocalTmux:
    """A private tmux server: TMUX_TMPDIR points at a short, per-test directory."""

    socket_dir: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "TMUX_TMPDIR": str(self.socket_dir)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", *args], env=self.env(), capture_output=True, text=True, check=check)


@pytest.fixture
def local_tmux(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalTmux]:
    """Real tmux on a private socket dir (set as TMUX_TMPDIR for the test); its server and everything
    running under it killed after."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed")
    socket_dir = Path(tempfile.mkdtemp(prefix="fleet-tmux-", dir="/tmp"))  # short: socket paths are limited
    monkeypatch.setenv("TMUX_TMPDIR", str(socket_dir))
    monkeypatch.delenv("TMUX", raising=False)
    tmux = LocalTmux(socket_dir)
    yield tmux
    # A run outlives its tmux server (run.sh ignores SIGHUP): whatever runs below the server is
    # killed with it, pass or fail, so no test leaves its run behind.
    server = tmux.run("display-message", "-p", "#{pid}", check=False).stdout.strip()
    below = descendants(int(server)) - {int(server)} if server.isdigit() else set()
    tmux.run("kill-server", check=False)
    kill([Proc(pid, "", "") for pid in below])
    shutil.rmtree(socket_dir, ignore_errors=True)


# ------------------------------------------------------------------ polling


LONG_PHASES = ("loading", "compiling", "evaluating", "checkpointing")
PHASE_SETTLED_S = 10.0  # a phase older than this has reported (progress events come every 10 s)


def phase_progress_gaps(seen: Sequence[Mapping[str, Any]]) -> list[str]:
    """`fab status --json` snapshots (each with the test's ``polled_at``) that show a phase of
    minutes without what a waiting user needs: a long phase past its first report without a
    fraction (or, once it moved, an ETA), training without a step or progress, a step without
    total and ETA. Empty when every snapshot shows the phase's fraction and ETA."""
    gaps = []
    for st in seen:
        settled = st.get("since") is not None and st["polled_at"] - st["since"] > PHASE_SETTLED_S
        if not settled:
            continue
        progress = st.get("progress")
        where = f"{st.get('state')} / {st.get('phase')}"
        if st.get("state") in LONG_PHASES:
            if progress is None or not progress.get("total"):
                gaps.append(f"{where}: no fraction ({progress})")
            elif progress.get("done", 0) > 0 and st.get("eta_s") is None:
                gaps.append(f"{where}: no ETA ({progress})")
        elif st.get("state") == "training":
            if st.get("step") is None and progress is None:
                gaps.append(f"{where}: neither a step nor progress")
            elif st.get("step") is not None and (not st.get("total_steps") or st.get("eta_s") is None):
                gaps.append(f"{where}: step {st.get('step')} without total or ETA")
    return gaps


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0, interval: float = 0.1) -> None:
    """Poll ``check()`` until true; fail naming ``what`` after a generous ``timeout`` (not a speed test)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for: {what}")
        time.sleep(interval)


def wait_status(
    fleet: RemoteFleet,
    read: Callable[[], dict[str, Any]],
    done: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 1800.0,
    interval: float = 1.0,
) -> dict[str, Any]:
    """``read()`` (the test's `fab status --json`) until ``done`` holds for a state that comes with
    the run's end; returned. Each `fab status` is a Python process and an SSH session (~1 s of CPU
    beside the run it waits for), so between the first read and the next ones this waits on the
    host's view of the container: until the run's wrapper has written its exit status, or no process
    of the run (run.sh and what it starts hold the run dir in their argv) is left, as after a SIGKILL
    to the group. Either way `fab status` then decides, as before."""
    holder: dict[str, Any] = {}

    def check() -> bool:
        holder["st"] = read()
        return done(holder["st"])

    if check():
        return holder["st"]
    run_id = holder["st"].get("run_id")
    if run_id:
        run_dir = f"{fleet.workdir}/runs/{run_id}"
        exit_file = fleet.hosts.ct_path(f"{run_dir}/{EXIT_CODE_FILE}")
        wait_for(
            f"{what}: its exit status or the end of its processes",
            lambda: exit_file.exists() or not processes_with(run_dir),
            timeout=timeout,
            interval=0.5,
        )
    wait_for(what, check, timeout=timeout, interval=interval)
    return holder["st"]


# ------------------------------------------------------------------ benchmark scripts


def script_module(path: str, name: str) -> Any:
    """The repo's script ``path`` (relative to the repo) imported as module ``name`` (scripts such
    as ``benchmarks/*.py`` and ``docs/generate.py`` are in no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def benchmark_module(name: str) -> Any:
    """``benchmarks/<name>.py`` imported as module ``name``."""
    return script_module(f"benchmarks/{name}.py", name)


# ------------------------------------------------------------------ tiny models and configs


def tiny_qwen3_config() -> Qwen3Config:
    """A 2-layer, 64-wide Qwen3 (vocab 256) whose logits are not near-uniform: a real model, tiny."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.3,  # a logit scale like a trained LM (0.02 gives near-uniform logits)
    )


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    """The tiny Qwen3 with weights drawn from ``seed``, in eval mode."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config()).eval()


@functools.cache
def smol_chat_template() -> str:
    """SmolLM2-135M-Instruct's chat template as its GGUF (the ``smol`` target's file) carries it:
    the template without the ~40 s of building the whole tokenizer from the GGUF."""
    import gguf

    from training.model.smol import gguf_path

    field = gguf.GGUFReader(str(gguf_path())).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


# One torch thread for a trainer a test starts: beside the other xdist worker's torch processes on a
# 2-core machine, a config's two threads spin on each other (a 60 s tiny run took 712 s in CI, the
# lifecycle scenario 502 s instead of 180 s).
ONE_THREAD = ("--train.torch_threads=1",)

# The tiny-cpu config cut to one compiled shape (one bucket of 64 tokens, one drafter layer, one
# mask variant): the cheapest real compile. benchmarks/compile_bench.py keeps a copy (TINY_CPU): it
# also runs on the GPU device, where pytest (which this module needs) may be absent.
TINY_COMPILE_OVERRIDES = (
    "--compile.enabled=on",
    "--data.num_buckets=1",
    "--data.max_length=64",
    "--data.token_budget=4096",
    "--data.max_batch_size=64",
    "--data.corpus_files=2",
    "--data.eval_prompts=0",
    "--drafter.num_layers=1",
    "--drafter.full_attention_layers=0",
    "--drafter.num_anchors=8",
    *ONE_THREAD,
)


# ------------------------------------------------------------------ other CPythons (3.12, 3.13)

OTHER_PYTHONS = ("3.12", "3.13")


def other_pythons() -> dict[str, str]:
    """version -> interpreter of the CPython 3.12 and 3.13 this machine has (PATH or pyenv)."""
    found: dict[str, str] = {}
    for version in OTHER_PYTHONS:
        installs = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
        candidates = [*(str(p) for p in installs), shutil.which(f"python{version}") or ""]
        for candidate in filter(None, candidates):
            probe = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                check=False,
            )
            if probe.returncode == 0 and probe.stdout.strip() == version:
                found[version] = candidate
                break
    return found


def require_other_pythons() -> dict[str, str]:
    """``other_pythons()``, all of them; skip without (fail when FLEET_TEST_REQUIRE_HOSTS=1, as in CI)."""
    found = other_pythons()
    missing = [v for v in OTHER_PYTHONS if v not in found]
    if missing:
        why = f"no CPython {', '.join(missing)} here (PATH or ~/.pyenv/versions)"
        if os.environ.get("FLEET_TEST_REQUIRE_HOSTS") == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return found


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` for a child the test interrupts with SIGINT, as Ctrl-C in a terminal would: the
    default SIGINT disposition, whatever the test process inherited (a non-interactive shell starts a
    background job, and so everything under it, with SIGINT ignored, and Python then never raises
    KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def llama_build() -> Any:
    """The real llama.cpp build (training.engines.llamacpp), once per machine: cached in
    $FLEET_LLAMACPP_CACHE (default ~/.cache/fleet-llama.cpp), so only the first session on a
    machine builds (minutes on 2 cores); the sdist from $FLEET_LLAMACPP_SDIST or PyPI."""
    import sys

    from training.engines.llamacpp import default_cache_root, ensure_llamacpp

    return ensure_llamacpp(default_cache_root(), log=lambda line: print(line, file=sys.stderr))


def framed(*parts: tuple[str, int, str]) -> str:
    """(name, exit code, text) -> what fleet/remote/prelude.sh's ``emit`` prints for each: a header
    ``@@fleet <name> <exit code> <lines>`` and the text, written here independently of it."""
    return "".join(f"@@fleet {name} {code} {text.count(chr(10)) + 1}\n{text}\n" for name, code, text in parts)
