"""The inventory: ``fleet.toml`` (or the file named by ``FLEET_CONFIG``) -> frozen dataclasses.

The whole file is validated before anything runs. Every problem becomes one
``ConfigError`` line that names the key (``targets.<name>.<key>``), says what is
wrong and what to write instead. Values are never interpreted by a shell later
(commands are argv lists), so a workdir with spaces or quotes is kept literally.
"""

from __future__ import annotations

import getpass
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from fleet.errors import ConfigError
from fleet.layout import Layout
from training.config import RunConfig, TrainingError, load_config
from training.contract import CONFIG_PATH_ENV, TARGET_ENV, Topology, parse_topology

NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
LXC_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

# Every default of the inventory is written once, on its dataclass below (or here); the parser
# reads it from there (``TargetSpec.keep_releases``).
STALL_WINDOW_S = 600.0  # no new event or log output for this long: a live run is "stalled"
KNOWN_HOSTS = "~/.ssh/known_hosts"
REPO_ROOT = Path(__file__).resolve().parent.parent  # this checkout: tasks.py, fleet.toml, training/

TOP_KEYS = ("default_target", "targets", "runs")
TARGET_KEYS = (
    "host",
    "identity_file",
    "host_key_policy",
    "known_hosts",
    "container",
    "workdir",
    "gpus",
    "topology",
    "env",
    "uv_cache",
    "keep_releases",
    "keep_runs",
    "stall_window_s",
    "llamacpp",
    "run",
    "commands",
    "gpu_gate",
    "notify",
)
SSH_ONLY_KEYS = ("identity_file", "host_key_policy", "known_hosts")
RUN_KEYS = (
    "module",
    "config",
    "overrides",
    "env",
    "restart",  # { max, backoff_s }: the run's wrapper relaunches a trainer that failed (off by default)
    "regen_servers",
)
MAX_OVERRIDES_BYTES = 32 * 1024
RESTART_KEYS = ("max", "backoff_s")
COMMAND_KEYS = ("tmux", "nvidia_smi", "uv", "python", "pct", "lxc_attach", "lxc_info")
GATE_KEYS = ("max_memory_mib", "expected_name", "timeout_s")
NOTIFY_KEYS = ("command", "url", "headers", "command_env")
HOST_KEY_POLICIES = ("strict", "accept-new")
MULTI_RUN_KEYS = (
    "targets",  # 2+ target names; node ranks in this order (the c10d rendezvous sorts them by addr: checked)
    "topology",
    "per_host",  # table target -> "N+M": each host's ranks, targets first (default: hosts filled in order)
    "rendezvous",
    "network",  # table target -> { addr, socket_ifname }: how the other hosts reach each one
    "run",
)
NETWORK_KEYS = ("addr", "socket_ifname")


@dataclass(frozen=True)
class SshSpec:
    """How an SSH target is reached; paths are absolute (``~`` expanded)."""

    user: str
    hostname: str
    port: int = 22
    identity_file: str | None = None  # the SSH key; none = the agent's and ~/.ssh's default keys
    # strict: known_hosts must know the host; accept-new: a host never seen is added on first use
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    known_hosts: str = field(default_factory=lambda: os.path.expanduser(KNOWN_HOSTS))  # read as ssh reads it

    @property
    def display(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


@dataclass(frozen=True)
class ContainerSpec:
    """The LXC container commands run in: ``pct`` with a numeric id, or ``lxc`` with a name."""

    type: Literal["pct", "lxc"]  # pct: `pct exec ID -- ...` (Proxmox); lxc: `lxc-attach -n NAME -- ...`
    id: int | None = None  # pct: the container's numeric id
    name: str | None = None  # lxc: the container's name

    @property
    def display(self) -> str:
        return f"container {self.id}" if self.type == "pct" else f"container {self.name}"


@dataclass(frozen=True)
class Commands:
    """Paths of the commands fleet runs on the host / in the container (tests point them at shims)."""

    tmux: str = "tmux"  # in the container (or on the host without one): runs the trainer's session
    nvidia_smi: str = "nvidia-smi"  # on the host and in the container: the GPU gate, status, doctor
    uv: str = "uv"  # builds the env; fleet pushes its own where this one is missing
    python: str = "python3"  # the interpreter where the target has no managed env (env = "")
    pct: str = "pct"  # on the Proxmox host
    lxc_attach: str = "lxc-attach"  # on the host of an lxc container
    lxc_info: str = "lxc-info"  # on the host of an lxc container: is it running


@dataclass(frozen=True)
class RunSpec:
    """What ``fab train`` starts: ``python -m <module> train --config <config> ... <overrides>``."""

    module: str = "training"  # python -m <module> train --config <config> --run-dir <dir> <overrides>
    config: str = "tiny-cpu"  # a shipped config's name (training/configs/) or a TOML path
    overrides: tuple[str, ...] = ()  # "--section.key=value" strings, e.g. ["--train.steps=50"]
    # Values may be secrets: never shown in repr, logs or errors.
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    # `restart = { max = 3, backoff_s = 60 }`: the run's wrapper relaunches a trainer that exited
    # non-zero, up to max times (0 = off, the default), never for a cause a restart cannot fix.
    restart_max: int = 0
    restart_backoff_s: float = 60.0  # seconds between a failed attempt and the next
    # OpenAI-compatible servers of the target model that `fab regen` sends prompts to (host:port or
    # URLs, as seen from the target: SGLang, vLLM, llama-server).
    regen_servers: tuple[str, ...] = ()
    # The run's shape: ``config`` + ``overrides`` read with the trainer's own loader at inventory
    # load, so every task sizes the run from this one object. None where the controller cannot read
    # it: another module than the bundled trainer, or a config path on a remote target.
    loaded: RunConfig | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class NotifySpec:
    """``[targets.X.notify]``: told when a run finishes, fails, is restarted or stalls. The URL and
    header values may hold secrets: never in repr, logs, errors or a command line."""

    command: tuple[str, ...] = ()  # argv run on the target, the JSON body on stdin
    url: str = field(default="", repr=False)  # POSTed the JSON body
    # HTTP headers sent with the POST (e.g. Authorization); their values are kept as secret as the URL
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    # run.env keys the command is given; by default none of the run's secrets reach it.
    command_env: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.command or self.url)


@dataclass(frozen=True)
class GateSpec:
    """The GPU gate before a launch (``fab gpus``, ``fab train``)."""

    max_memory_mib: int = 64  # a GPU using more (with no process: a zombie CUDA context) is not clean
    expected_name: str = ""  # "" = any; else every GPU's name must contain it (e.g. "H200")
    timeout_s: float = 20.0  # nvidia-smi must answer within this


@dataclass(frozen=True)
class TargetSpec:
    """One validated target of the inventory."""

    name: str
    host: str  # "local" (this machine) or "user@host[:port]" (SSH)
    workdir: str  # releases, runs, envs, caches; local: relative to fleet.toml or ~; remote: absolute
    ssh: SshSpec | None = None
    # The LXC container commands run in: { type = "pct", id = 200 } or { type = "lxc", name = "train" }
    container: ContainerSpec | None = None
    commands: Commands = field(default_factory=Commands)  # command paths on the host / in the container
    gpus: int = 0  # 0 = a CPU run; else the GPUs the container sees, the topology's sum
    # "N+M": N target ranks + M drafter ranks, summing to gpus (default: the run config's
    # pipeline.topology; the inventory's wins)
    topology: Topology | None = None
    env: str = ""  # envs/<name>/{pyproject.toml,uv.lock} built on the target; "" = commands.python as is
    uv_cache: str = ""  # "" = <workdir>/uv-cache; else a path on the target (e.g. a shared bind mount)
    run: RunSpec = field(default_factory=RunSpec)  # what `fab train` starts
    gpu_gate: GateSpec = field(default_factory=GateSpec)  # when a GPU counts as clean
    notify: NotifySpec = field(default_factory=NotifySpec)  # off unless url or command is set
    keep_releases: int = 5  # releases `fab deploy` keeps (and always the live and latest runs')
    keep_runs: int = 10  # run dirs kept by `fab train` (the newest; never the live or latest one)
    stall_window_s: float = STALL_WINDOW_S  # no event and no log line for this long: "stalled"
    # `fab deploy` also builds llama.cpp (training.engines.llamacpp, cached on the target): "off",
    # "cpu", or "auto" (CUDA where nvcc and a GPU are). Off by default: the first build takes
    # minutes (tens of minutes on 2 cores); `fab export --gguf` / `fab serve-bench` build it anyway.
    llamacpp: str = "off"

    @property
    def is_local(self) -> bool:
        return self.ssh is None

    @property
    def layout(self) -> Layout:
        return Layout(self.workdir)

    @property
    def run_python(self) -> str:
        """The interpreter runs use: the managed env's python, else ``commands.python``."""
        return self.layout.env_python(self.env) if self.env else self.commands.python

    @property
    def display(self) -> str:
        """Where it is, for messages: ``local``, ``root@pve:22``, ``root@pve:22 container 200``."""
        where = "local" if self.ssh is None else self.ssh.display
        return f"{where} {self.container.display}" if self.container else where


@dataclass(frozen=True)
class NodeSpec:
    """One host of a run over several hosts: its target, how many ranks it runs, its network."""

    target: str
    nproc: int  # processes (one per GPU; on CPU, gloo processes) torchrun starts on this host
    addr: str  # the address the other hosts reach this one at (torchrun --local-addr)
    socket_ifname: str = ""  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for its ranks ("" = theirs)
    split: tuple[int, int] = (0, 0)  # (target ranks, drafter ranks) of this host, nproc in all


@dataclass(frozen=True)
class MultiRunSpec:
    """``[runs.NAME]``: one N+M job over several targets, one torchrun agent per target, joined by
    torchrun's c10d rendezvous. Global ranks go host by host in ``nodes`` order, so host ``i`` runs
    ranks ``first_rank(i) ..``: its ``split`` of target ranks first, then its drafter ranks
    (``training.contract.Topology.placement``)."""

    name: str
    topology: Topology  # "N+M" over all hosts
    nodes: tuple[NodeSpec, ...]
    rendezvous: str  # host:port of the c10d store, served by the first host's agent
    run: RunSpec = field(default_factory=RunSpec)  # as [targets.NAME.run]: config, overrides, env, restart

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(n.target for n in self.nodes)

    def first_rank(self, index: int) -> int:
        return sum(n.nproc for n in self.nodes[:index])

    def node_of_rank(self, rank: int) -> int:
        """The index in ``nodes`` of the host that runs global rank ``rank``."""
        for i in range(len(self.nodes)):
            if rank < self.first_rank(i + 1):
                return i
        raise ValueError(f"rank {rank} is outside the run's {self.topology.world_size} ranks")

    def split(self, index: int) -> tuple[int, int]:
        """(targets, drafters) that host ``index`` runs."""
        return self.nodes[index].split

    @property
    def placement(self) -> str:
        """The trainer's ``--placement``: each host's split in node order (``"5+3,5+3"``)."""
        return ",".join(f"{t}+{d}" for t, d in (n.split for n in self.nodes))

    @property
    def checkpoint_node(self) -> int:
        """The host of drafter 0 (the first host with drafters): it writes the checkpoints."""
        return next(i for i, n in enumerate(self.nodes) if n.split[1] > 0)


@dataclass(frozen=True)
class Inventory:
    """The whole validated inventory."""

    path: Path
    default_target: str  # what tasks act on without FLEET_TARGET (default: the first target)
    targets: Mapping[str, TargetSpec]  # [targets.NAME]: one table per target
    runs: Mapping[str, MultiRunSpec] = field(default_factory=lambda: MappingProxyType({}))  # [runs.NAME]

    @property
    def root(self) -> Path:
        """The directory of the inventory file (relative local paths are resolved from it)."""
        return self.path.parent


def default_inventory_path() -> Path:
    """``$FLEET_CONFIG`` if set, else the ``fleet.toml`` of this checkout (next to ``tasks.py``)."""
    env = os.environ.get(CONFIG_PATH_ENV)
    return Path(env).expanduser() if env else REPO_ROOT / "fleet.toml"


def load_inventory(path: Path | None = None) -> Inventory:
    """Read and validate the inventory at ``path`` (default: :func:`default_inventory_path`)."""
    path = (path if path is not None else default_inventory_path()).expanduser().absolute()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: inventory not found; create it (see README) or point {CONFIG_PATH_ENV} at one"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the inventory: {err.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the inventory as UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: TOML syntax error: {err}; fix that line") from None
    return parse_inventory(data, path)


def parse_inventory(data: Mapping[str, Any], path: Path) -> Inventory:
    """Validate parsed TOML ``data`` (from the file at ``path``) into an :class:`Inventory`."""
    _check_keys(data, TOP_KEYS, "", path)
    targets_raw = data.get("targets")
    if targets_raw is None:
        raise ConfigError(f"{path}: no targets; add a [targets.<name>] table (see README)")
    _check_type(targets_raw, dict, "targets", "a table of [targets.<name>]", path)
    if not targets_raw:
        raise ConfigError(f"{path}: `targets` is empty; add a [targets.<name>] table (see README)")
    targets: dict[str, TargetSpec] = {}
    for name, raw in targets_raw.items():
        if not NAME_RE.match(name):
            raise ConfigError(
                f"{path}: targets.{name!r}: target names may only use letters, digits, '_' and '-'; rename it"
            )
        _check_type(raw, dict, f"targets.{name}", "a table", path)
        targets[name] = _parse_target(name, raw, path)
    runs_raw = data.get("runs", {})
    _check_type(runs_raw, dict, "runs", "a table of [runs.<name>]", path)
    runs: dict[str, MultiRunSpec] = {}
    for name, raw in runs_raw.items():
        if not NAME_RE.match(name) or name == "all" or name in targets:
            raise ConfigError(
                f"{path}: runs.{name!r}: a run name uses letters, digits, '_' and '-', is not 'all' and "
                f"no target's name ({TARGET_ENV} selects either); rename it"
            )
        _check_type(raw, dict, f"runs.{name}", "a table", path)
        runs[name] = _parse_multi_run(name, raw, targets, path)
    default = data.get("default_target")
    if default is None:
        default = next(iter(targets))
    _check_type(default, str, "default_target", "a target name string", path)
    if default not in targets and default not in runs:
        raise ConfigError(
            f"{path}: default_target = {default!r} is not a target; use one of: {', '.join(targets)}"
        )
    return Inventory(
        path=path, default_target=default, targets=MappingProxyType(targets), runs=MappingProxyType(runs)
    )


def selected_name(inv: Inventory, name: str | None = None) -> str:
    """``name``, else ``$FLEET_TARGET``, else the default target (a target, a run, or ``all``)."""
    return (name if name is not None else os.environ.get(TARGET_ENV) or inv.default_target).strip()


def select_run(inv: Inventory, name: str | None = None) -> MultiRunSpec | None:
    """The run over several hosts that ``FLEET_TARGET`` (or ``name``) names, else None."""
    return inv.runs.get(selected_name(inv, name))


def member_spec(inv: Inventory, run: MultiRunSpec, index: int) -> TargetSpec:
    """Host ``index`` of ``run`` as a target whose run is the multi-host run's."""
    spec = inv.targets[run.nodes[index].target]
    return replace(spec, run=run.run, topology=None)


def select_targets(inv: Inventory, name: str | None = None, *, allow_all: bool) -> list[TargetSpec]:
    """The targets a task acts on: ``name``, else ``$FLEET_TARGET``, else the default target.

    ``all`` selects every target, allowed only for read-only tasks (``allow_all``).
    """
    name = selected_name(inv, name)
    if name in inv.runs:
        if not allow_all:
            raise ConfigError(
                f"{TARGET_ENV}={name} is a run over several hosts ({', '.join(inv.runs[name].targets)}): "
                "this task acts on one target; pick one of them (deploy, train, stop, status and logs "
                "take the run)"
            )
        run = inv.runs[name]
        return [member_spec(inv, run, i) for i in range(len(run.nodes))]
    if name == "all":
        if not allow_all:
            raise ConfigError(
                f"{TARGET_ENV}=all is only allowed for read-only tasks (status, logs); "
                f"pick one target: {', '.join(inv.targets)}"
            )
        return list(inv.targets.values())
    if name not in inv.targets:
        raise ConfigError(
            f"{TARGET_ENV}={name!r} is not in {inv.path}; use one of: {', '.join(inv.targets)}"
            + (" or all" if allow_all else "")
        )
    return [inv.targets[name]]


# --- one target ---------------------------------------------------------------------------------


def _parse_target(name: str, raw: Mapping[str, Any], path: Path) -> TargetSpec:
    key = f"targets.{name}"
    _check_keys(raw, TARGET_KEYS, key, path)
    host = raw.get("host")
    if host is None:
        raise ConfigError(f'{path}: {key}.host is missing; write host = "local" or host = "user@host[:port]"')
    _check_type(host, str, f"{key}.host", '"local" or "user@host[:port]"', path)
    ssh = None if host == "local" else _parse_ssh(key, host, raw, path)
    if ssh is None:
        for only in SSH_ONLY_KEYS:
            if only in raw:
                raise ConfigError(f"{path}: {key}.{only} only applies to SSH hosts; remove it or set host")
    container = _parse_container(key, raw.get("container"), path)
    workdir = _parse_workdir(key, raw.get("workdir"), ssh is None, path)
    gpus = _int(raw, "gpus", key, path, default=TargetSpec.gpus, minimum=0)
    run = _parse_run(key, raw.get("run"), path, local=ssh is None)
    topology = _parse_topology(key, raw.get("topology"), gpus, path)
    if topology is None:
        topology = _config_topology(key, run, gpus, path)
    env = _str(raw, "env", key, path, default=TargetSpec.env)
    if env and not NAME_RE.match(env):
        raise ConfigError(
            f"{path}: {key}.env = {env!r}: env names use letters, digits, '_', '-' (envs/<name>)"
        )
    return TargetSpec(
        name=name,
        host=host,
        workdir=workdir,
        ssh=ssh,
        container=container,
        commands=_parse_commands(key, raw.get("commands"), path),
        gpus=gpus,
        topology=topology,
        env=env,
        uv_cache=_parse_uv_cache(key, raw.get("uv_cache"), ssh is None, path),
        run=run,
        gpu_gate=_parse_gate(key, raw.get("gpu_gate"), path),
        notify=_parse_notify(key, raw.get("notify"), path),
        keep_releases=_int(raw, "keep_releases", key, path, default=TargetSpec.keep_releases, minimum=1),
        keep_runs=_int(raw, "keep_runs", key, path, default=TargetSpec.keep_runs, minimum=1),
        stall_window_s=_number(raw, "stall_window_s", key, path, default=TargetSpec.stall_window_s),
        llamacpp=_parse_llamacpp(key, raw, path),
    )


LLAMACPP_MODES = ("off", "cpu", "auto")


def _parse_llamacpp(key: str, raw: Mapping[str, Any], path: Path) -> str:
    value = _str(raw, "llamacpp", key, path, default=TargetSpec.llamacpp)
    if value not in LLAMACPP_MODES:
        raise ConfigError(
            f'{path}: {key}.llamacpp = {value!r}: use "off", "cpu" or "auto" (CUDA where nvcc is)'
        )
    return value


def _parse_ssh(key: str, host: str, raw: Mapping[str, Any], path: Path) -> SshSpec:
    m = re.match(r"^(?:([^@]+)@)?(\[[0-9A-Fa-f:.]+\]|[^:@\[\]]+)(?::(\d+))?$", host)
    hostname = m.group(2) if m else ""
    bad = (
        m is None
        or (m.group(1) is not None and not USER_RE.match(m.group(1)))
        or not (hostname.startswith("[") or HOSTNAME_RE.match(hostname))
    )
    if bad:
        raise ConfigError(
            f'{path}: {key}.host = {host!r} is not "local" or "user@host[:port]"; e.g. "root@pve.example:22"'
        )
    assert m is not None
    port = int(m.group(3)) if m.group(3) else SshSpec.port
    if not 1 <= port <= 65535:
        raise ConfigError(f"{path}: {key}.host: port {port} is out of range; use 1-65535")
    policy = _str(raw, "host_key_policy", key, path, default=SshSpec.host_key_policy)
    if policy not in HOST_KEY_POLICIES:
        raise ConfigError(
            f'{path}: {key}.host_key_policy = {policy!r}; use "strict" (known_hosts) or "accept-new"'
        )
    identity = raw.get("identity_file")
    if identity is not None:
        _check_type(identity, str, f"{key}.identity_file", "a path string", path)
        identity = _local_path(identity, path, f"{key}.identity_file")
    known_hosts = _str(raw, "known_hosts", key, path, default=KNOWN_HOSTS)
    known_hosts = _local_path(known_hosts, path, f"{key}.known_hosts")
    return SshSpec(
        user=m.group(1) or getpass.getuser(),
        hostname=hostname.strip("[]"),
        port=port,
        identity_file=identity,
        host_key_policy=policy,  # type: ignore[arg-type]
        known_hosts=known_hosts,
    )


def _parse_container(key: str, raw: Any, path: Path) -> ContainerSpec | None:
    if raw is None:
        return None
    ckey = f"{key}.container"
    example = '{ type = "pct", id = 200 } or { type = "lxc", name = "train" }'
    _check_type(raw, dict, ckey, example, path)
    _check_keys(raw, ("type", "id", "name"), ckey, path)
    kind = raw.get("type")
    if kind == "pct":
        if "name" in raw:
            raise ConfigError(f'{path}: {ckey}.name is for type "lxc"; pct containers use id = <number>')
        cid = raw.get("id")
        if isinstance(cid, str) and cid.strip().isdigit():
            cid = int(cid)
        if not isinstance(cid, int) or isinstance(cid, bool) or not 100 <= cid <= 999_999_999:
            raise ConfigError(
                f"{path}: {ckey}.id = {cid!r}: a pct container id is a number from 100 up; e.g. id = 200"
            )
        return ContainerSpec(type="pct", id=cid)
    if kind == "lxc":
        if "id" in raw:
            raise ConfigError(f'{path}: {ckey}.id is for type "pct"; lxc containers use name = "<name>"')
        cname = raw.get("name")
        if not isinstance(cname, str) or not LXC_NAME_RE.match(cname):
            raise ConfigError(
                f"{path}: {ckey}.name = {cname!r}: use letters, digits, '_', '-', '.'; e.g. name = \"train\""
            )
        return ContainerSpec(type="lxc", name=cname)
    raise ConfigError(f"{path}: {ckey}.type = {kind!r}; use {example}")


# fleet's tree under a workdir (bin/uv, envs/, releases/, runs/, current, ...) must never land on
# system paths: not inside these trees at all ...
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)
# ... and not directly in these directories (a directory of its own below them is fine).
SYSTEM_DIRS = (
    "/",
    "/home",
    "/media",
    "/mnt",
    "/opt",
    "/root",
    "/run",
    "/srv",
    "/tmp",
    "/var",
    "/var/cache",
    "/var/lib",
    "/var/local",
    "/var/log",
    "/var/opt",
    "/var/spool",
    "/var/tmp",
)


def _parse_workdir(key: str, raw: Any, local: bool, path: Path) -> str:
    wkey = f"{key}.workdir"
    if raw is None:
        hint = '".fleet/<name>"' if local else '"/workspace/fleet"'
        raise ConfigError(f"{path}: {wkey} is missing; e.g. workdir = {hint}")
    _check_type(raw, str, wkey, "a path string", path)
    if not raw.strip() or any(c in raw for c in "\0\n\r"):
        raise ConfigError(f"{path}: {wkey} = {raw!r} is empty or has control characters; write a plain path")
    if ".." in raw.split("/"):
        raise ConfigError(f"{path}: {wkey} = {raw!r} goes through '..'; write the directory's own path")
    if local:
        workdir = _local_path(raw, path)
    elif not raw.startswith("/"):
        raise ConfigError(
            f'{path}: {wkey} = {raw!r}: a remote workdir must be absolute; e.g. workdir = "/workspace/fleet"'
        )
    else:
        workdir = os.path.normpath(raw).replace("//", "/")
    system = [d for d in SYSTEM_DIRS if workdir == d]
    system += [t for t in SYSTEM_TREES if workdir == t or workdir.startswith(t + "/")]
    if local and workdir == os.path.expanduser("~"):
        system.append(workdir)
    if system:
        raise ConfigError(
            f"{path}: {wkey} = {raw!r} would put fleet's tree (bin/, envs/, releases/, runs/) into "
            f'{system[0]}; give it a directory of its own, e.g. workdir = "/workspace/fleet"'
        )
    return workdir


def _parse_uv_cache(key: str, raw: Any, local: bool, path: Path) -> str:
    """``uv_cache``: the uv cache dir on the target; absolute, or ~/relative for local."""
    if raw is None:
        return ""
    _check_type(raw, str, f"{key}.uv_cache", "a path string", path)
    if not raw.strip() or any(c in raw for c in "\0\n\r"):
        raise ConfigError(f"{path}: {key}.uv_cache = {raw!r}: write a plain path or remove the key")
    if local:
        return _local_path(raw, path)
    if not raw.startswith("/"):
        raise ConfigError(f'{path}: {key}.uv_cache = {raw!r} must be absolute; e.g. "/mnt/uv-cache"')
    return os.path.normpath(raw)


def _parse_topology(key: str, raw: Any, gpus: int, path: Path) -> Topology | None:
    if raw is None:
        return None
    tkey = f"{key}.topology"
    _check_type(raw, str, tkey, 'a string "N+M" (target GPUs + drafter GPUs)', path)
    try:
        topo = parse_topology(raw)
    except ValueError:
        raise ConfigError(
            f'{path}: {tkey} = {raw!r} is not "N+M" with N, M >= 1; e.g. topology = "5+3"'
        ) from None
    if topo.world_size != gpus:
        raise ConfigError(
            f"{path}: {tkey} = {raw!r} sums to {topo.world_size} but {key}.gpus = {gpus}; make them agree"
        )
    return topo


def _config_topology(key: str, run: RunSpec, gpus: int, path: Path) -> Topology | None:
    """The run config's ``pipeline.topology`` where the target sets none: the inventory's
    ``topology`` wins, the config's is the default, and either must fit ``gpus``."""
    text = run.loaded.pipeline.topology if run.loaded is not None else ""
    if not text:
        return None
    where = f"{key}.run.config = {run.config!r}"
    try:
        topo = parse_topology(text)
    except ValueError:
        raise ConfigError(
            f'{path}: {where}: its pipeline.topology = {text!r} is not "N+M" with N, M >= 1; fix it'
        ) from None
    if topo.world_size != gpus:
        raise ConfigError(
            f'{path}: {where} has pipeline.topology = "{topo}" ({topo.world_size} GPUs) but {key}.gpus = '
            f'{gpus}; set {key}.gpus and {key}.topology to agree, or add "--pipeline.topology=" to '
            f"{key}.run.overrides for one process"
        )
    return topo


def _load_run_config(
    rkey: str, config: str, overrides: tuple[str, ...], local: bool, path: Path
) -> RunConfig | None:
    """``load_config(config, overrides)`` as the trainer will: a config name is a file of the shipped
    ``training/configs``; a path is read here only on a local target (elsewhere it is the target's)."""
    is_path = "/" in config or config.endswith(".toml")
    if is_path and not (local and Path(config).expanduser().is_absolute()):
        return None
    try:
        return load_config(config, overrides)
    except TrainingError as err:
        raise ConfigError(f"{path}: {rkey}: {err}") from None


def _parse_multi_run(
    name: str, raw: Mapping[str, Any], targets: Mapping[str, TargetSpec], path: Path
) -> MultiRunSpec:
    """``[runs.NAME]``, validated as a whole against its targets."""
    key = f"runs.{name}"
    _check_keys(raw, MULTI_RUN_KEYS, key, path)
    members = raw.get("targets")
    if (
        not isinstance(members, list)
        or len(members) < 2
        or not all(isinstance(t, str) for t in members)
        or len(set(members)) != len(members)
    ):
        raise ConfigError(
            f'{path}: {key}.targets must list two or more distinct targets; e.g. ["pve1", "pve2"]'
        )
    for t in members:
        if t not in targets:
            raise ConfigError(
                f"{path}: {key}.targets: {t!r} is not a target; use one of: {', '.join(targets)}"
            )
    specs = [targets[t] for t in members]
    envs = {s.env for s in specs}
    if len(envs) > 1:
        listed = ", ".join(f"{s.name} env = {s.env!r}" for s in specs)
        raise ConfigError(
            f"{path}: {key}: its targets use different envs ({listed}); one run needs the same env lock "
            "on every host: give them the same env"
        )
    kinds = {s.gpus > 0 for s in specs}
    if len(kinds) > 1:
        raise ConfigError(
            f"{path}: {key}: some targets have GPUs and some not "
            f"({', '.join(f'{s.name} gpus = {s.gpus}' for s in specs)}); "
            "one run runs on GPUs everywhere (NCCL) or on CPU everywhere (gloo)"
        )
    text = raw.get("topology")
    _check_type(text, str, f"{key}.topology", 'a string "N+M" (target ranks + drafter ranks)', path)
    try:
        topo = parse_topology(text)
    except ValueError:
        raise ConfigError(
            f'{path}: {key}.topology = {text!r} is not "N+M" with N, M >= 1; e.g. "10+6"'
        ) from None
    splits = _node_splits(key, raw.get("per_host"), topo, specs, path)
    rendezvous = raw.get("rendezvous")
    _check_type(rendezvous, str, f"{key}.rendezvous", '"host:port" reachable from every target', path)
    m = re.match(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d+)$", rendezvous)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(
            f'{path}: {key}.rendezvous = {rendezvous!r} is not "host:port"; e.g. "10.0.0.1:29400" '
            "(the first target's address: its torchrun agent serves the rendezvous)"
        )
    network = raw.get("network", {})
    _check_type(
        network, dict, f"{key}.network", 'a table per target; e.g. { pve1 = { addr = "10.0.0.1" } }', path
    )
    for t in network:
        if t not in members:
            raise ConfigError(
                f"{path}: {key}.network.{t}: not one of the run's targets ({', '.join(members)})"
            )
    nodes = []
    for t, split in zip(members, splits, strict=True):
        nkey = f"{key}.network.{t}"
        hints = network.get(t, {})
        _check_type(hints, dict, nkey, 'a table; e.g. { addr = "10.0.0.2", socket_ifname = "eth0" }', path)
        _check_keys(hints, NETWORK_KEYS, nkey, path)
        addr = hints.get("addr")
        if not isinstance(addr, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9.:-]*$", addr):
            raise ConfigError(
                f"{path}: {nkey}.addr is missing or not an address; write the address the other hosts "
                f'reach {t} at, e.g. addr = "10.0.0.2" (torchrun --local-addr)'
            )
        ifname = _str(hints, "socket_ifname", nkey, path, default="")
        if ifname and not re.match(r"^[A-Za-z0-9_.^,=-]+$", ifname):
            raise ConfigError(f'{path}: {nkey}.socket_ifname = {ifname!r}: an interface name, e.g. "eth0"')
        nodes.append(NodeSpec(target=t, nproc=sum(split), addr=addr, socket_ifname=ifname, split=split))
    addrs = [n.addr for n in nodes]
    if len(set(addrs)) != len(addrs) or addrs != sorted(addrs):
        raise ConfigError(
            f"{path}: {key}: torchrun's c10d rendezvous numbers the hosts by their address, sorted as text "
            f"({', '.join(f'{n.target} {n.addr}' for n in nodes)}): list {key}.targets in that order, "
            "each with its own addr"
        )
    run = _parse_run(key, raw.get("run"), path, local=all(s.is_local for s in specs))
    if run.module != "training":
        raise ConfigError(
            f"{path}: {key}.run.module = {run.module!r}: a run over several hosts needs the bundled "
            'trainer ("training")'
        )
    return MultiRunSpec(name=name, topology=topo, nodes=tuple(nodes), rendezvous=rendezvous, run=run)


def _node_splits(
    key: str, raw: Any, topo: Topology, specs: list[TargetSpec], path: Path
) -> list[tuple[int, int]]:
    """(target ranks, drafter ranks) per host: ``per_host``, else ranks per host from each
    target's ``gpus`` (CPU: the world split evenly) filled host by host, targets first."""
    world = topo.world_size
    if raw is None:
        if specs[0].gpus > 0:
            nprocs = [s.gpus for s in specs]
            if sum(nprocs) != world:
                raise ConfigError(
                    f'{path}: {key}.topology = "{topo}" needs {world} GPUs but its targets have '
                    f"{' + '.join(str(n) for n in nprocs)} = {sum(nprocs)}; make them agree, or give per_host"
                )
        elif world % len(specs):
            raise ConfigError(
                f'{path}: {key}.topology = "{topo}": {world} CPU ranks do not split evenly over '
                f'{len(specs)} targets; give per_host = {{ target = "N+M", ... }}'
            )
        else:
            nprocs = [world // len(specs)] * len(specs)
        splits, start, n = [], 0, topo.targets
        for nproc in nprocs:
            end = start + nproc
            splits.append((min(end, n) - min(start, n), max(end, n) - max(start, n)))
            start = end
        return splits
    _check_type(raw, dict, f"{key}.per_host", 'a table; e.g. { pve1 = "5+3", pve2 = "5+3" }', path)
    names = [s.name for s in specs]
    if sorted(raw) != sorted(names):
        raise ConfigError(
            f"{path}: {key}.per_host must give every target of the run once: {', '.join(names)}"
        )
    splits = []
    for s in specs:
        value = raw[s.name]
        try:
            t, d = (int(x) for x in str(value).split("+"))
            if t < 0 or d < 0 or t + d < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f'{path}: {key}.per_host.{s.name} = {value!r} is not "N+M"; e.g. "2+6"'
            ) from None
        if s.gpus and t + d > s.gpus:
            raise ConfigError(
                f"{path}: {key}.per_host.{s.name} = {value!r} needs {t + d} GPUs but {s.name} has "
                f"gpus = {s.gpus}"
            )
        splits.append((t, d))
    if (sum(t for t, _ in splits), sum(d for _, d in splits)) != (topo.targets, topo.drafters):
        raise ConfigError(f'{path}: {key}.per_host does not add up to topology = "{topo}"; make them agree')
    return splits


def _parse_commands(key: str, raw: Any, path: Path) -> Commands:
    if raw is None:
        return Commands()
    ckey = f"{key}.commands"
    _check_type(raw, dict, ckey, "a table of command paths", path)
    _check_keys(raw, COMMAND_KEYS, ckey, path)
    values: dict[str, str] = {}
    for name in COMMAND_KEYS:
        if name in raw:
            value = _str(raw, name, ckey, path, default="")
            if not value.strip() or any(c in value for c in "\0\n\r"):
                raise ConfigError(f"{path}: {ckey}.{name} = {value!r}: give a command name or path")
            values[name] = value
    return Commands(**values)


def _parse_run(key: str, raw: Any, path: Path, *, local: bool) -> RunSpec:
    if raw is None:
        raw = {}
    rkey = f"{key}.run"
    _check_type(raw, dict, rkey, "a table", path)
    _check_keys(raw, RUN_KEYS, rkey, path)
    module = _str(raw, "module", rkey, path, default=RunSpec.module)
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", module):
        raise ConfigError(f'{path}: {rkey}.module = {module!r} is not a Python module name; e.g. "training"')
    config = _str(raw, "config", rkey, path, default=RunSpec.config)
    if not config.strip() or any(c in config for c in "\0\n\r"):
        raise ConfigError(f'{path}: {rkey}.config = {config!r}: give a config name or path; e.g. "tiny-cpu"')
    overrides = raw.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f'{path}: {rkey}.overrides must be a list of strings; e.g. ["--train.steps=50"]')
    size = sum(len(o.encode("utf-8", "surrogateescape")) + 1 for o in overrides)
    if size > MAX_OVERRIDES_BYTES:
        # They travel in the command line of every remote step (twice in the launch's: argv and
        # run.json), which the remote shell gets as one argument of at most 128 KiB.
        raise ConfigError(
            f"{path}: {rkey}.overrides are {size} bytes in all, over the {MAX_OVERRIDES_BYTES} a remote "
            "command line carries safely; put long values in a config file (`--config`) instead"
        )
    for i, override in enumerate(overrides):
        if "\0" in override:
            raise ConfigError(
                f"{path}: {rkey}.overrides[{i}] = {override!r} has a NUL byte, which no command line "
                "can carry; remove it"
            )
    env = raw.get("env", {})
    _check_type(env, dict, f"{rkey}.env", 'a table of strings; e.g. { HF_HOME = "/data/hf" }', path)
    for env_key, value in env.items():
        if not ENV_KEY_RE.match(env_key):
            raise ConfigError(
                f"{path}: {rkey}.env: {env_key!r} is not an environment variable name; "
                "use [A-Za-z_][A-Za-z0-9_]*"
            )
        if not isinstance(value, str):
            # The value itself may be a secret: name only its type.
            raise ConfigError(
                f"{path}: {rkey}.env.{env_key} must be a string, not {_type_name(value)}; quote it"
            )
        if "\0" in value:  # never shown: it may be a secret
            raise ConfigError(
                f"{path}: {rkey}.env.{env_key} has a NUL byte, which no environment can carry; remove it"
            )
    restart = raw.get("restart", {})
    _check_type(restart, dict, f"{rkey}.restart", "a table; e.g. { max = 3, backoff_s = 60 }", path)
    _check_keys(restart, RESTART_KEYS, f"{rkey}.restart", path)
    restart_max = _int(restart, "max", f"{rkey}.restart", path, default=RunSpec.restart_max, minimum=0)
    backoff = _number(restart, "backoff_s", f"{rkey}.restart", path, default=RunSpec.restart_backoff_s)
    servers = raw.get("regen_servers", [])
    if not isinstance(servers, list) or not all(
        isinstance(a, str) and a.strip() and not any(c.isspace() or c == "\0" for c in a) for a in servers
    ):
        raise ConfigError(
            f'{path}: {rkey}.regen_servers must be a list of addresses; e.g. ["10.0.0.5:30000"]'
        )
    loaded = None
    if module == RunSpec.module:
        loaded = _load_run_config(rkey, config, tuple(overrides), local, path)
    return RunSpec(
        module=module,
        config=config,
        overrides=tuple(overrides),
        env=MappingProxyType(dict(env)),
        restart_max=restart_max,
        restart_backoff_s=backoff,
        regen_servers=tuple(servers),
        loaded=loaded,
    )


def _parse_notify(key: str, raw: Any, path: Path) -> NotifySpec:
    if raw is None:
        return NotifySpec()
    nkey = f"{key}.notify"
    _check_type(raw, dict, nkey, 'a table; e.g. { url = "https://hooks.example/..." }', path)
    _check_keys(raw, NOTIFY_KEYS, nkey, path)
    command = raw.get("command", [])
    if not isinstance(command, list) or not all(isinstance(a, str) and "\0" not in a for a in command):
        raise ConfigError(
            f'{path}: {nkey}.command must be an argv list of strings; e.g. ["/usr/local/bin/page-me"]'
        )
    url = raw.get("url", "")
    # The URL may hold a token: the messages name the key, never the value. Printable ASCII only
    # (what urllib sends as is): a control character would make the notifier fail on the target.
    if not isinstance(url, str) or (url and not re.fullmatch(r"https?://[!-~]+", url)):
        raise ConfigError(
            f"{path}: {nkey}.url must be an http:// or https:// URL of printable ASCII without spaces "
            "(percent-encode anything else)"
        )
    command_env = raw.get("command_env", [])
    if not isinstance(command_env, list) or not all(
        isinstance(k, str) and ENV_KEY_RE.match(k) for k in command_env
    ):
        raise ConfigError(
            f"{path}: {nkey}.command_env must be a list of keys of {key}.run.env the command may see; "
            'e.g. ["PAGER_TOKEN"]'
        )
    headers = raw.get("headers", {})
    _check_type(
        headers, dict, f"{nkey}.headers", 'a table of strings; e.g. { Authorization = "Bearer ..." }', path
    )
    for name, value in headers.items():
        if (
            not re.match(r"^[A-Za-z0-9-]+$", name)
            or not isinstance(value, str)
            or not all(c == "\t" or " " <= c <= "~" or "\xa0" <= c <= "\xff" for c in value)
        ):
            # http.client sends header values as latin-1 and refuses control characters.
            raise ConfigError(
                f"{path}: {nkey}.headers.{name}: give a header name of letters, digits and '-' "
                "and a one-line value of printable latin-1 characters"
            )
    return NotifySpec(
        command=tuple(command),
        url=url,
        headers=MappingProxyType(dict(headers)),
        command_env=tuple(command_env),
    )


def _parse_gate(key: str, raw: Any, path: Path) -> GateSpec:
    if raw is None:
        return GateSpec()
    gkey = f"{key}.gpu_gate"
    _check_type(raw, dict, gkey, "a table", path)
    _check_keys(raw, GATE_KEYS, gkey, path)
    return GateSpec(
        max_memory_mib=_int(raw, "max_memory_mib", gkey, path, default=GateSpec.max_memory_mib, minimum=0),
        expected_name=_str(raw, "expected_name", gkey, path, default=GateSpec.expected_name),
        timeout_s=_number(raw, "timeout_s", gkey, path, default=GateSpec.timeout_s),
    )


# --- small checks -------------------------------------------------------------------------------


def _local_path(value: str, path: Path, key: str = "") -> str:
    """A path on this machine: ``~`` expanded, relative paths from the inventory's directory."""
    if "\0" in value:
        raise ConfigError(f"{path}: {key or 'a path'} = {value!r} has a NUL byte; write a plain path")
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = path.parent / p
    return os.path.normpath(p)


def _check_keys(raw: Mapping[str, Any], allowed: tuple[str, ...], where: str, path: Path) -> None:
    for k in raw:
        if k not in allowed:
            full = f"{where}.{k}" if where else k
            raise ConfigError(f"{path}: unknown key {full}; allowed here: {', '.join(allowed)}")


def _type_name(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "a table"})
    return names.get(type(value), type(value).__name__)


def _check_type(value: Any, kind: type, key: str, expected: str, path: Path) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: {key} must be {expected}, not {_type_name(value)}")


def _str(raw: Mapping[str, Any], name: str, key: str, path: Path, *, default: str) -> str:
    value = raw.get(name, default)
    _check_type(value, str, f"{key}.{name}", "a string", path)
    return value


def _int(raw: Mapping[str, Any], name: str, key: str, path: Path, *, default: int, minimum: int) -> int:
    value = raw.get(name, default)
    _check_type(value, int, f"{key}.{name}", f"an integer >= {minimum}", path)
    if value < minimum:
        raise ConfigError(f"{path}: {key}.{name} = {value} must be >= {minimum}")
    return value


def _number(raw: Mapping[str, Any], name: str, key: str, path: Path, *, default: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{path}: {key}.{name} must be a positive number of seconds, not {value!r}")
    return float(value)
