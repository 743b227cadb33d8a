"""`fab doctor`'s pure parsers of its scripts' output (tested on recorded real output) and its
thresholds (docs/doctor.md "`fab doctor` (`fleet.doctor`)")."""

from __future__ import annotations

import posixpath
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fleet.errors import FleetError
from fleet.gpus import GpuHealth, parse_health_xml

if TYPE_CHECKING:
    pass


Status = Literal["ok", "warn", "fail", "skip"]
GIB = 1024**3
MIB = 1024**2

# Thresholds (docs/doctor.md "`fab doctor` (`fleet.doctor`)")
SHM_MIN_BYTES = 1 * GIB  # NCCL's shared-memory transport and DataLoader workers; Docker's 64 MB fails
MEMLOCK_MIN_KIB = 64 * 1024  # below it NCCL over InfiniBand/RDMA cannot register its buffers
NOFILE_FAIL = 1024
NOFILE_WARN = 4096
COMPILE_CACHE_RESERVE = 2 * GIB  # inductor + triton cache of one key, generous
ENV_RESERVE = 10 * GIB  # a torch + CUDA venv that `fab deploy` will build in the workdir
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two moments
RANK_OVERHEAD = 3 * GIB  # host memory per training process (CUDA context, torch, python)
DEFAULT_TOKENS_PER_S = 20_000.0  # the user's measured 5+3 rate (field notes)

GPU_NODE_RE = re.compile(r"^/dev/nvidia(\d+)$")
GPU_COLUMN_RE = re.compile(r"^GPU\d+$")
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CAPS_DIR = "/dev/nvidia-caps"
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
MODULE_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")
LIB_VERSION_RE = re.compile(r"^(libnvidia-ml|libcuda)\.so\.(\d+\.\d+(?:\.\d+)*)$")
# Clock event reasons that mean the GPU is being held back (idle, app clocks, sync boost do not)
SLOWDOWN_REASONS = {
    "sw_power_cap": "software power cap",
    "hw_slowdown": "hardware slowdown",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "hardware power brake",
    "sw_thermal_slowdown": "software thermal slowdown",
}


# --- pure parsers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CtConfig:
    """A container's config as ``pct config`` prints it (or an LXC config file): keys and lxc.* lines."""

    keys: Mapping[str, str] = field(default_factory=dict)
    lxc: tuple[tuple[str, str], ...] = ()

    def lxc_values(self, *names: str) -> list[str]:
        return [value for key, value in self.lxc if key in names]


def parse_ct_config(text: str) -> CtConfig:
    """``pct config <id>`` output (``key: value``; ``lxc.key: value``) or an LXC config (``lxc.key = value``).

    Pattern of PVE::LXC::Config::parse_pct_config: snapshot sections (``[name]``) end the current
    config; ``#`` lines are the description.
    """
    keys: dict[str, str] = {}
    lxc: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if re.match(r"^\[[^\]]+\]\s*$", line):
            break
        if m := re.match(r"^(lxc\.[a-z0-9_\-.]+)\s*(?::|=)\s*(.*?)\s*$", line):
            lxc.append((m.group(1), m.group(2)))
        elif m := re.match(r"^([a-z][a-z_]*\d*):\s*(.*?)\s*$", line):
            keys[m.group(1)] = m.group(2)
    return CtConfig(keys, tuple(lxc))


@dataclass(frozen=True)
class DeviceRule:
    """One ``lxc.cgroup[2].devices.allow`` line: ``c 195:* rwm`` (``None`` = ``*``), or ``a``."""

    kind: str  # "c", "b" or "a" (all devices)
    major: int | None
    minor: int | None
    access: str
    cgroup_v1: bool
    line: str

    def allows(self, major: int, minor: int | None) -> bool:
        if "r" not in self.access or "w" not in self.access:
            return False
        if self.kind == "a":
            return True
        if self.kind != "c" or (self.major is not None and self.major != major):
            return False
        return self.minor is None or (minor is not None and self.minor == minor)


def parse_device_rules(config: CtConfig) -> list[DeviceRule]:
    rules = []
    for key, value in config.lxc:
        if key not in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            continue
        v1 = key == "lxc.cgroup.devices.allow"
        line = f"{key}: {value}"
        words = value.split()
        if words[:1] == ["a"]:
            rules.append(DeviceRule("a", None, None, "rwm", v1, line))
            continue
        m = re.match(r"^([cb])\s+(\*|\d+):(\*|\d+)\s*([rwm]*)$", value.strip())
        if m:
            major = None if m.group(2) == "*" else int(m.group(2))
            minor = None if m.group(3) == "*" else int(m.group(3))
            rules.append(DeviceRule(m.group(1), major, minor, m.group(4) or "rwm", v1, line))
    return rules


def mounted_paths(config: CtConfig) -> dict[str, str]:
    """Container path -> the line that provides it: ``lxc.mount.entry`` targets and ``devN:`` entries."""
    found: dict[str, str] = {}
    for value in config.lxc_values("lxc.mount.entry"):
        words = value.split()
        if len(words) >= 2:
            found["/" + words[1].strip("/")] = f"lxc.mount.entry: {value}"
    for key, value in config.keys.items():
        if re.match(r"^dev\d+$", key):
            first = value.split(",")[0]
            path = first.split("=", 1)[1] if first.startswith("path=") else first
            found[path] = f"{key}: {value}"
    return found


def dev_entries(config: CtConfig) -> set[str]:
    """Paths passed with ``devN:`` (Proxmox creates the node and its cgroup rule itself)."""
    return {p for p, line in mounted_paths(config).items() if re.match(r"^dev\d+:", line)}


@dataclass(frozen=True)
class Node:
    """A device node (or directory) as ``stat -c '%n|%F|%t|%T'`` shows it."""

    path: str
    kind: str  # "char", "dir", "block" or what stat said
    major: int | None
    minor: int | None


def parse_nodes(text: str) -> dict[str, Node]:
    nodes = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        path, ftype, major, minor = parts
        kind = {"character special file": "char", "directory": "dir", "block special file": "block"}
        is_dev = ftype in ("character special file", "block special file")
        nodes[path] = Node(
            path,
            kind.get(ftype, ftype),
            int(major, 16) if is_dev else None,
            int(minor, 16) if is_dev else None,
        )
    return nodes


def parse_proc_devices(text: str) -> dict[str, int]:
    """``/proc/devices`` lines ``511 nvidia-uvm`` -> ``{"nvidia-uvm": 511}``."""
    majors = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0].isdigit():
            majors[words[1]] = int(words[0])
    return majors


def parse_module_version(text: str) -> str | None:
    """The kernel module's version from ``/proc/driver/nvidia/version`` (proprietary or open module)."""
    m = MODULE_RE.search(text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class NvLibs:
    """The NVIDIA user-space libraries a container has: every version found, and the one loaded."""

    versions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # lib -> versions on disk
    loaded: Mapping[str, str] = field(default_factory=dict)  # lib -> version `<lib>.so.1` resolves to


def parse_libs(text: str) -> NvLibs:
    """Lines ``link NAME TARGET`` / ``file NAME REALPATH`` of ``doctor_container.sh``'s ``libs``."""
    versions: dict[str, set[str]] = {}
    loaded: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) != 3:
            continue
        kind, name, real = words
        m = LIB_VERSION_RE.match(posixpath.basename(real))
        if not m:
            continue
        lib, version = m.group(1), m.group(2)
        versions.setdefault(lib, set()).add(version)
        if kind == "link" and posixpath.basename(name) == f"{lib}.so.1":
            loaded.setdefault(lib, version)  # search order: the first .so.1 is the one ld finds
    for lib, found in versions.items():
        if lib not in loaded and len(found) == 1:
            loaded[lib] = next(iter(found))
    return NvLibs({k: tuple(sorted(v)) for k, v in versions.items()}, loaded)


def parse_gpu_matrix(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m`` or ``topo -p2p r``: the GPU x GPU cells (``NV18``, ``PHB``, ``OK``, ``GNS``).

    Tabs or the spaces a terminal copy turns them into, ANSI styling, NIC columns and the legend
    are all tolerated: GPU columns come first in the header, GPU rows start with ``GPUn``.
    """
    columns: list[int] = []
    cells: dict[tuple[int, int], str] = {}
    for raw in text.splitlines():
        words = ANSI_RE.sub("", raw).split()
        if not words:
            continue
        gpu_words = [w for w in words if GPU_COLUMN_RE.match(w)]
        if not columns and len(words) > 1 and GPU_COLUMN_RE.match(words[1]):  # the header: GPU0 GPU1 ...
            columns = [int(w[3:]) for w in gpu_words]
            continue
        if columns and GPU_COLUMN_RE.match(words[0]):  # a row: GPUn, then one cell per GPU column
            row = int(words[0][3:])
            for col, cell in zip(columns, words[1 : 1 + len(columns)], strict=False):
                cells[(row, col)] = cell
    return cells


@dataclass(frozen=True)
class GpuState:
    """One GPU of ``nvidia-smi -q -x``: what `fab doctor` reports on clocks and health."""

    index: int
    name: str
    uuid: str
    minor: int | None
    bus_id: str | None
    persistence: bool | None
    slowdowns: tuple[str, ...]
    ecc_enabled: bool | None
    ecc_uncorrected: int | None
    health: GpuHealth | None


@dataclass(frozen=True)
class SmiXml:
    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[GpuState, ...]


def _int_or_none(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def parse_smi_xml(text: str) -> SmiXml:
    """Driver and CUDA versions and, per GPU, persistence, clock event reasons, ECC and health."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise FleetError(f"nvidia-smi -q -x printed invalid XML ({err})") from None
    health = {h.uuid: h for h in parse_health_xml(text)}
    gpus = []
    for index, gpu in enumerate(root.iter("gpu")):
        slowdowns = []
        for reasons in (gpu.find("clocks_event_reasons"), gpu.find("clocks_throttle_reasons")):
            for child in reasons if reasons is not None else ():
                key = re.sub(r"^clocks_(event|throttle)_reason_", "", child.tag)
                if key in SLOWDOWN_REASONS and (child.text or "").strip() == "Active":
                    slowdowns.append(SLOWDOWN_REASONS[key])
        volatile = gpu.find("ecc_errors/volatile")
        uncorrected = None
        if volatile is not None:
            counts = [_int_or_none(e.text) for e in volatile.iter() if "uncorrectable" in e.tag]
            old = _int_or_none(volatile.findtext("double_bit/total"))
            numbers = [c for c in [*counts, old] if c is not None]
            uncorrected = sum(numbers) if numbers else None
        ecc = (gpu.findtext("ecc_mode/current_ecc") or "").strip()
        persistence = (gpu.findtext("persistence_mode") or "").strip()
        uuid = (gpu.findtext("uuid") or "").strip()
        gpus.append(
            GpuState(
                index=index,
                name=(gpu.findtext("product_name") or "?").strip(),
                uuid=uuid,
                minor=_int_or_none(gpu.findtext("minor_number")),
                bus_id=(gpu.findtext("pci/pci_bus_id") or gpu.get("id") or "").strip() or None,
                persistence=None if persistence not in ("Enabled", "Disabled") else persistence == "Enabled",
                slowdowns=tuple(slowdowns),
                ecc_enabled=None if ecc not in ("Enabled", "Disabled") else ecc == "Enabled",
                ecc_uncorrected=uncorrected,
                health=health.get(uuid),
            )
        )
    return SmiXml(
        (root.findtext("driver_version") or "").strip() or None,
        (root.findtext("cuda_version") or "").strip() or None,
        tuple(gpus),
    )


def parse_df(text: str) -> tuple[int, int, str] | None:
    """``df -P -k PATH``: (total bytes, available bytes, mount point)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    words = lines[-1].split()
    if len(words) < 6 or not words[1].isdigit() or not words[3].isdigit():
        return None
    return int(words[1]) * 1024, int(words[3]) * 1024, words[-1]


def parse_keyed(text: str) -> dict[str, str]:
    """``key value`` lines (the ``ulimit`` and ``memory`` sections)."""
    return {w[0]: w[1] for w in (line.split(None, 1) for line in text.splitlines()) if len(w) == 2}


def memory_limit(ct_config: CtConfig | None, memory_section: str) -> tuple[int, str] | None:
    """The container's memory limit in bytes and where it was read: pct's ``memory`` (MiB), the
    cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else ``MemTotal`` (lxcfs shows the
    limit there in a Proxmox container)."""
    if ct_config is not None and ct_config.keys.get("memory", "").isdigit():
        return int(ct_config.keys["memory"]) * MIB, "pct config memory"
    facts = parse_keyed(memory_section)
    for key, label in (("cgroup2", "cgroup memory.max"), ("cgroup1", "cgroup memory.limit_in_bytes")):
        value = facts.get(key, "-")
        if value.isdigit() and int(value) < 2**60:
            return int(value), label
    if facts.get("meminfo", "").isdigit():
        return int(facts["meminfo"]) * 1024, "/proc/meminfo MemTotal"
    return None
