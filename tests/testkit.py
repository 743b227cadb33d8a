"""Shared test helpers, written once: the real test host (sshd + LXC + pct shim), the real `fab`,
a private tmux, `wait_for`, the tiny Qwen3 target and the tiny compile config.

The `hosts` tier needs `tests/hosts/setup` (root) to have run; its facts are read from
`tests/hosts/.state/hosts.env`. Without them the tier is skipped with the reason, unless
`FLEET_TEST_REQUIRE_HOSTS=1` (CI), where a missing host is a failure.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parent.parent
HOSTS_ENV = Path(os.environ.get("FLEET_TEST_HOSTS_ENV") or REPO / "tests" / "hosts" / ".state" / "hosts.env")
FAB = REPO / ".venv" / "bin" / "fab"
SETUP_HINT = "test host not set up: run tests/hosts/setup"


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
    """An inventory text; each target's dict values become `[targets.NAME.KEY]` tables."""
    lines = [f"default_target = {toml_value(default_target)}", ""]
    for name, spec in targets.items():
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
        return run_fab(args, self.config, timeout=timeout, env=env)


def run_fab(
    args: Sequence[str],
    config: Path,
    *,
    timeout: float = 180,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """The real `fab` as a subprocess, in the repo root, with FLEET_CONFIG=config."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    full_env.update({"FLEET_CONFIG": str(config), "PYTHONUNBUFFERED": "1", **(env or {})})
    return subprocess.run(
        [str(FAB), *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def remote_fleet(hosts: TestHost, tmp_path: Path) -> Iterator[RemoteFleet]:
    """fleet.toml in tmp_path with target `ct200`, a fresh workdir and a private tmux server.

    Several suites (and benchmarks) share container 200; each test's `commands.tmux` is a
    two-line wrapper in the container around the real tmux with its own socket (`tmux -L`),
    so their `fleet-run` sessions never meet. Everything is removed after the test.
    """
    label = f"fleet-test-{uuid.uuid4().hex[:10]}"
    workdir = f"/workspace/{label}"
    tmux = f"/tmp/{label}-tmux"
    wrapper = hosts.ct_path(tmux)
    wrapper.write_text(f'#!/bin/sh\nexec tmux -L {label} "$@"\n')
    wrapper.chmod(0o755)
    target = ct200_target(hosts, workdir)
    target["commands"] = {**target["commands"], "tmux": tmux}
    fleet = RemoteFleet(hosts, tmp_path / "fleet.toml", workdir, target)
    fleet.write()
    yield fleet
    # A run survives its tmux server (run.sh ignores SIGHUP): stop it the fleet way, then kill
    # whatever still names this test's unique workdir, then remove the test's files.
    fleet.write(**target)
    try:
        fleet.fab("stop", "--force", timeout=60)
    except subprocess.TimeoutExpired:
        pass  # the kill below is the safety net
    hosts.pct_exec("tmux", "-L", label, "kill-server", check=False)
    kill_processes_naming(workdir)
    hosts.pct_exec("rm", "-rf", "--", workdir, tmux, check=False)


def kill_processes_naming(text: str) -> list[int]:
    """SIGKILL every process (host view, containers included) whose command line contains ``text``."""
    needle = text.encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return killed


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
    """Real tmux on a private socket dir (set as TMUX_TMPDIR for the test); its server killed after."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed")
    socket_dir = Path(tempfile.mkdtemp(prefix="fleet-tmux-", dir="/tmp"))  # short: socket paths are limited
    monkeypatch.setenv("TMUX_TMPDIR", str(socket_dir))
    monkeypatch.delenv("TMUX", raising=False)
    tmux = LocalTmux(socket_dir)
    yield tmux
    tmux.run("kill-server", check=False)
    shutil.rmtree(socket_dir, ignore_errors=True)


# ------------------------------------------------------------------ polling


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0, interval: float = 0.1) -> None:
    """Poll ``check()`` until true; fail naming ``what`` after a generous ``timeout`` (not a speed test)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for: {what}")
        time.sleep(interval)


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
    "--train.torch_threads=1",
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
