"""`fab doctor`'s verdict (pure): the facts its scripts answered -> one :class:`Finding` per check, in
:class:`DoctorReport`; the checks are the table ``CHECKS``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from io import StringIO
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fleet.doctor.needs import RunNeeds
from fleet.doctor.parse import (
    ANSI_RE,
    CAPS_DIR,
    CHECKPOINT_BYTES_PER_PARAM,
    COMPILE_CACHE_RESERVE,
    CONTROL_NODES,
    ENV_RESERVE,
    GIB,
    GPU_NODE_RE,
    MEMLOCK_MIN_KIB,
    MIB,
    NOFILE_FAIL,
    NOFILE_WARN,
    RANK_OVERHEAD,
    SHM_MIN_BYTES,
    CtConfig,
    Node,
    SmiXml,
    Status,
    dev_entries,
    memory_limit,
    mounted_paths,
    parse_ct_config,
    parse_device_rules,
    parse_df,
    parse_gpu_matrix,
    parse_keyed,
    parse_libs,
    parse_module_version,
    parse_nodes,
    parse_proc_devices,
    parse_smi_xml,
)
from fleet.envs import cuda_mismatch, gpu_arch_problem
from fleet.errors import FleetError, tail_lines
from fleet.gpus import smi_failure
from fleet.remote import Answer

if TYPE_CHECKING:
    from fleet.inventory import TargetSpec


# --- findings and the report -------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One check: its status and one line (what, where, and for a problem the fix)."""

    area: str  # run | passthrough | driver | nccl | topology | health | bandwidth
    check: str
    status: Status
    message: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.check}: {self.message}"
        return f"{text}; fix: {self.fix}" if self.fix else text


@dataclass(frozen=True)
class Bandwidth:
    """A measured send/recv between one target and one drafter rank (``fab doctor --bandwidth``)."""

    backend: str  # nccl | gloo
    devices: tuple[str, ...]
    bytes: int
    iterations: int
    seconds: tuple[float, ...]
    gb_per_s: float
    need_gb_per_s: float | None
    tokens_per_s: float
    hidden_bytes_per_token: int


@dataclass(frozen=True)
class DoctorReport:
    """`fab doctor`'s verdict for one target."""

    target: str
    where: str
    gpus: int
    findings: tuple[Finding, ...]
    topology: str = ""  # the GPU rows of `nvidia-smi topo -m`
    topology_from: str = ""  # where it ran: the Proxmox host or the target
    bandwidth: Bandwidth | None = None
    needs: RunNeeds | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == "fail")

    def summary(self) -> str:
        """One line: the verdict, or the failed checks by name."""
        if self.ok:
            warns = sum(f.status == "warn" for f in self.findings)
            return f"fit to train ({len(self.findings)} checks, {warns} warning(s))"
        names = ", ".join(dict.fromkeys(f.check for f in self.failures))
        return f"{len(self.failures)} problem(s): {names} (the FAIL lines above say what to do)"

    def text(self, width: int = 140) -> str:
        """A rich table of every check, the topology, then one plain line per problem and the verdict."""
        out = Console(file=StringIO(), width=width, color_system=None, markup=False, highlight=False)
        table = Table(title=f"fab doctor: {self.target} ({self.where})", title_justify="left")
        for column in ("status", "area", "check", "finding"):
            table.add_column(column, overflow="fold")
        for f in self.findings:
            table.add_row(f.status.upper(), f.area, f.check, f.message + (f"; fix: {f.fix}" if f.fix else ""))
        out.print(table)
        lines = [out.file.getvalue().rstrip("\n")]  # type: ignore[attr-defined]
        if self.topology:
            lines += [f"nvidia-smi topo -m, GPU rows ({self.topology_from}):", self.topology]
        # one line each, never wrapped: what to grep for and what to do
        lines += [f"{f.status.upper()} {f.line()}" for f in self.findings if f.status in ("fail", "warn")]
        lines.append(f"{self.target}: {'OK' if self.ok else 'NOT FIT'}: {self.summary()}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        data["lines"] = [f.line() for f in self.findings]
        return json.dumps(data, indent=2, default=str)


# --- evaluation (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the doctor scripts answered: the host's sections (None without a container) and the
    container's (or the target's) sections."""

    container: Mapping[str, Answer]
    host: Mapping[str, Answer] | None = None


def answer_text(parts: Mapping[str, Answer] | None, name: str) -> str:
    answer = (parts or {}).get(name)
    return answer.output if answer is not None and answer.exit_code == 0 else ""


def _size(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class Inputs:
    """What every check reads: the target, the scripts' answers, the run's sizes."""

    spec: TargetSpec
    facts: Facts
    needs: RunNeeds
    ct_config: CtConfig | None  # the container's config, from its Proxmox host
    smi: SmiXml | None  # nvidia-smi -q -x (GPU targets)


# The checks, in report order: (area, GPU targets only, the check). On a CPU target the GPU-only
# ones are one "do not apply" line.
CHECKS: tuple[tuple[str, bool, Callable[[Inputs], list[Finding]]], ...] = (
    ("run", False, lambda i: [_run_size(i.needs)]),
    ("passthrough", True, lambda i: _passthrough(i.spec, i.facts, i.ct_config)),
    ("driver", True, lambda i: _driver(i.spec, i.facts)),
    ("nccl", False, lambda i: _nccl(i.spec, i.facts.container, i.ct_config, i.needs)),
    ("topology", True, lambda i: _topology(i.spec, i.facts, i.smi)),
    ("health", True, lambda i: _health(i.spec, i.facts, i.smi)),
)
NOT_APPLYING = Finding(
    "gpu", "GPU checks", "skip", "gpus = 0: passthrough, driver, topology and health do not apply"
)


def evaluate(
    spec: TargetSpec, facts: Facts, needs: RunNeeds, bandwidth: Bandwidth | Finding | None = None
) -> DoctorReport:
    """Every finding of ``CHECKS`` from the facts, then the bandwidth probe's result (pure)."""
    ct = facts.container
    ct_config = parse_ct_config(answer_text(facts.host, "ct_config")) if facts.host is not None else None
    inputs = Inputs(spec, facts, needs, ct_config, _smi_xml(facts) if spec.gpus > 0 else None)
    findings: list[Finding] = []
    for _, gpu_only, run_check in CHECKS:
        if gpu_only and spec.gpus == 0:
            if NOT_APPLYING not in findings:
                findings.append(NOT_APPLYING)
            continue
        findings += run_check(inputs)
    topology = ""
    if spec.gpus > 0:
        topo_text = answer_text(facts.host, "topo") if facts.host is not None else answer_text(ct, "topo")
        topology = "\n".join(
            ANSI_RE.sub("", line).rstrip()
            for line in topo_text.splitlines()
            if line.strip().startswith("GPU")
        )
    if isinstance(bandwidth, Finding):  # the probe could not measure
        findings.append(bandwidth)
        bandwidth = None
    elif bandwidth is not None:
        findings.append(_bandwidth_finding(bandwidth))
    where = spec.container.display if spec.container else spec.display
    topology_from = f"the host of {where}" if facts.host is not None else where
    return DoctorReport(
        spec.name, where, spec.gpus, tuple(findings), topology, topology_from, bandwidth, needs
    )


def _run_size(needs: RunNeeds) -> Finding:
    """What the sizes below are judged against: the run config's target and drafter."""
    shape = needs.shape
    if not needs.known or shape is None:
        return Finding(
            "run", "run size", "skip", f"run config {needs.config!r} is not readable here: sizes unknown"
        )
    target = f"{_size(needs.target_bytes)}" if needs.target_bytes is not None else "size unknown"
    return Finding(
        "run",
        "run size",
        "ok",
        f"{needs.config}: target ({needs.kind}) {shape.hidden_size} wide, {shape.num_hidden_layers} layers, "
        f"vocab {shape.vocab_size:,} ({target}); drafter {_count(needs.drafter_params)} params; "
        f"{needs.target_layers} x {shape.hidden_size} x {needs.dtype_bytes} B hidden states per token",
    )


def _smi_xml(facts: Facts) -> SmiXml | None:
    text = (
        answer_text(facts.host, "smi_xml")
        if facts.host is not None
        else answer_text(facts.container, "smi_xml")
    )
    if not text:
        text = answer_text(facts.container, "smi_xml")
    try:
        return parse_smi_xml(text) if text else None
    except FleetError:
        return None


def _device_numbers(
    path: str, ct_nodes: Mapping[str, Node], host_nodes: Mapping[str, Node], majors: Mapping[str, int]
) -> tuple[int, int | None] | None:
    for nodes in (ct_nodes, host_nodes):
        node = nodes.get(path)
        if node is not None and node.major is not None:
            return node.major, node.minor
    if m := GPU_NODE_RE.match(path):
        return majors.get("nvidia", 195), int(m.group(1))
    uvm = majors.get("nvidia-uvm")
    return {
        "/dev/nvidiactl": (majors.get("nvidia", 195), 255),
        "/dev/nvidia-uvm": (uvm, 0) if uvm is not None else None,
        "/dev/nvidia-uvm-tools": (uvm, 1) if uvm is not None else None,
        CAPS_DIR: (majors["nvidia-caps"], None) if "nvidia-caps" in majors else None,
    }.get(path)


def _mount_line(path: str) -> str:
    create = "dir" if path == CAPS_DIR else "file"
    return f'"lxc.mount.entry: {path} {path.lstrip("/")} none bind,optional,create={create}"'


def _passthrough(spec: TargetSpec, facts: Facts, ct_config: CtConfig | None) -> list[Finding]:
    """Container config lines (host side) and the device nodes the container has."""
    findings: list[Finding] = []
    ct_nodes = parse_nodes(answer_text(facts.container, "nodes"))
    gpu_nodes = sorted(
        (int(m.group(1)), p) for p, n in ct_nodes.items() if (m := GPU_NODE_RE.match(p)) and n.kind == "char"
    )
    where = spec.container.display if spec.container else spec.display
    if spec.container is not None and facts.host is not None:
        findings += _config_lines(spec, facts, ct_config, ct_nodes)
    # the device nodes the run opens
    shown = ", ".join(p for _, p in gpu_nodes) or "none"
    if len(gpu_nodes) < spec.gpus:
        fix = (
            "pass the GPUs through (see the passthrough findings) and restart the container"
            if spec.container
            else f"load the NVIDIA driver (nvidia-smi creates the nodes) or fix targets.{spec.name}.gpus"
        )
        findings.append(
            Finding(
                "passthrough",
                "GPU device nodes",
                "fail",
                f"{where} has {len(gpu_nodes)} GPU device node(s) ({shown}), gpus = {spec.gpus}",
                fix,
            )
        )
    else:
        findings.append(
            Finding(
                "passthrough",
                "GPU device nodes",
                "ok",
                f"{where} has {len(gpu_nodes)} ({shown}), gpus = {spec.gpus}",
            )
        )
    host_nodes = parse_nodes(answer_text(facts.host, "nodes")) if facts.host is not None else {}
    missing = [p for p in CONTROL_NODES if ct_nodes.get(p, Node(p, "", None, None)).kind != "char"]
    for path in missing:
        if spec.container is None:
            fix = "load nvidia_uvm (`nvidia-modprobe -u -c=0`)" if "uvm" in path else "load the NVIDIA driver"
        elif facts.host is not None and path not in host_nodes:
            fix = (
                f"the host has no {path} either: run `nvidia-modprobe -u -c=0` on the host, "
                "then restart the container"
            )
        else:
            fix = f"add {_mount_line(path)} to the container config and restart it"
        findings.append(Finding("passthrough", path, "fail", f"{where} has no {path}", fix))
    if not missing:
        findings.append(
            Finding("passthrough", "control nodes", "ok", f"{where} has {', '.join(CONTROL_NODES)}")
        )
    return findings


def _config_lines(
    spec: TargetSpec, facts: Facts, ct_config: CtConfig | None, ct_nodes: Mapping[str, Node]
) -> list[Finding]:
    assert spec.container is not None
    label = f"pct config {spec.container.id}" if spec.container.type == "pct" else "the LXC config"
    conf_file = (
        f"/etc/pve/lxc/{spec.container.id}.conf"
        if spec.container.type == "pct"
        else f"/var/lib/lxc/{spec.container.name}/config"
    )
    config_answer = (facts.host or {}).get("ct_config")
    if ct_config is None or config_answer is None or config_answer.exit_code != 0:
        why = tail_lines(config_answer.output, 1) if config_answer else "no answer"
        return [
            Finding(
                "passthrough",
                "container config",
                "fail",
                f"`{label}` failed: {why}",
                f"check commands.pct and that {spec.container.display} exists on the host",
            )
        ]
    findings: list[Finding] = []
    mounted = mounted_paths(ct_config)
    devs = dev_entries(ct_config)
    rules = parse_device_rules(ct_config)
    cgroup2 = answer_text(facts.host, "cgroupfs").strip() == "cgroup2fs"
    host_nodes = parse_nodes(answer_text(facts.host, "nodes"))
    majors = parse_proc_devices(answer_text(facts.host, "proc_devices"))
    gpu_paths = sorted((int(m.group(1)), p) for p in mounted if (m := GPU_NODE_RE.match(p)))
    if len(gpu_paths) < spec.gpus:
        have = {i for i, _ in gpu_paths}
        add = [f"/dev/nvidia{i}" for i in range(spec.gpus + len(gpu_paths)) if i not in have]
        add = add[: spec.gpus - len(gpu_paths)]
        findings.append(
            Finding(
                "passthrough",
                "GPU mount entries",
                "fail",
                f"{label} passes {len(gpu_paths)} GPU(s) "
                f"({', '.join(p for _, p in gpu_paths) or 'none'}), gpus = {spec.gpus}: "
                f"no lxc.mount.entry for {', '.join(add)}",
                f"add {', '.join(_mount_line(p) for p in add)} to {conf_file} and restart the container",
            )
        )
    else:
        findings.append(
            Finding(
                "passthrough",
                "GPU mount entries",
                "ok",
                f"{label} passes {', '.join(p for _, p in gpu_paths)}",
            )
        )
    required = [p for _, p in gpu_paths] + list(CONTROL_NODES)
    for path in [*CONTROL_NODES, CAPS_DIR]:
        if path not in mounted:
            status: Status = "warn" if path == CAPS_DIR else "fail"
            why = " (only MIG and some capabilities need it)" if path == CAPS_DIR else ""
            findings.append(
                Finding(
                    "passthrough",
                    f"{path} mount entry",
                    status,
                    f"{label} has no lxc.mount.entry for {path}{why}",
                    f"add {_mount_line(path)} to {conf_file} and restart the container",
                )
            )
    # cgroup rules: every device the run opens must be readable and writable
    caps_nodes = [p for p in {**host_nodes, **ct_nodes} if p.startswith(CAPS_DIR + "/")]
    checked = [p for p in required if p in mounted] + sorted(set(caps_nodes))
    if CAPS_DIR in mounted and not caps_nodes:
        checked.append(CAPS_DIR)
    usable = [r for r in rules if not (cgroup2 and r.cgroup_v1)]
    not_allowed: list[str] = []
    v1_only: list[str] = []
    unknown: list[str] = []
    for path in checked:
        if path in devs:
            continue
        numbers = _device_numbers(path, ct_nodes, host_nodes, majors)
        if path.startswith(CAPS_DIR + "/") and numbers is None:
            numbers = (majors["nvidia-caps"], None) if "nvidia-caps" in majors else None
        if numbers is None:
            unknown.append(path)
            continue
        major, minor = numbers
        if any(r.allows(major, minor) for r in usable):
            continue
        if any(r.allows(major, minor) for r in rules):
            v1_only.append(path)
        else:
            not_allowed.append(f"{path} (c {major}:{'*' if minor is None else minor})")
    if v1_only:
        findings.append(
            Finding(
                "passthrough",
                "cgroup v1 device rules",
                "fail",
                f"{label} allows {', '.join(v1_only)} only with lxc.cgroup.devices.allow, which this "
                "cgroup v2 host ignores",
                f"rename those lines to lxc.cgroup2.devices.allow in {conf_file} and restart the container",
            )
        )
    if not_allowed:
        majors_needed = sorted({p.split("(c ")[1].split(":")[0] for p in not_allowed})
        lines = ", ".join(f'"lxc.cgroup2.devices.allow: c {m}:* rwm"' for m in majors_needed)
        findings.append(
            Finding(
                "passthrough",
                "cgroup device rules",
                "fail",
                f"{label} has no lxc.cgroup2.devices.allow rule for {', '.join(not_allowed)}: "
                "CUDA cannot open them",
                f"add {lines} to {conf_file} and restart the container",
            )
        )
    if unknown:
        findings.append(
            Finding(
                "passthrough",
                "cgroup device rules",
                "warn",
                f"cannot check the cgroup rules for {', '.join(unknown)}: their device numbers are unknown "
                "(no node on the host or in the container)",
                "load nvidia_uvm on the host (`nvidia-modprobe -u -c=0`)",
            )
        )
    if not v1_only and not not_allowed and not unknown:
        findings.append(
            Finding(
                "passthrough",
                "cgroup device rules",
                "ok",
                f"{label} allows {len(checked)} NVIDIA device(s)"
                f" ({'cgroup v2' if cgroup2 else 'host cgroup'})",
            )
        )
    return findings


def _driver(spec: TargetSpec, facts: Facts) -> list[Finding]:
    findings: list[Finding] = []
    ct = facts.container
    where = spec.container.display if spec.container else spec.display
    smi = _smi_xml(facts)
    module, source = None, ""
    for parts, label in (
        (ct, "/proc/driver/nvidia/version"),
        (facts.host, "the host's /proc/driver/nvidia/version"),
    ):
        if parts is not None and (version := parse_module_version(answer_text(parts, "module"))):
            module, source = version, label
            break
    if module is None and smi is not None and smi.driver_version:
        module, source = smi.driver_version, "nvidia-smi driver_version"
    libs = parse_libs(answer_text(ct, "libs"))
    ct_smi = ct.get("smi_xml")
    if ct_smi is not None and ct_smi.exit_code != 0 and "version mismatch" in ct_smi.output.lower():
        findings.append(
            Finding(
                "driver",
                "NVML in the container",
                "fail",
                f"nvidia-smi in {where}: {smi_failure(ct_smi, spec.commands.nvidia_smi)}",
                f"install the user-space driver {module or '(the host module version)'} without its kernel "
                "module in the container",
            )
        )
    if module is None:
        findings.append(
            Finding(
                "driver",
                "kernel module",
                "fail",
                "no NVIDIA kernel module version (/proc/driver/nvidia/version "
                "missing and nvidia-smi gave none)",
                "load the NVIDIA driver on the host (`nvidia-smi` there)",
            )
        )
    for lib in ("libnvidia-ml", "libcuda"):
        loaded = libs.loaded.get(lib)
        all_versions = libs.versions.get(lib, ())
        if loaded is None:
            detail = (
                f" (versions on disk: {', '.join(all_versions)}, no {lib}.so.1 link)" if all_versions else ""
            )
            findings.append(
                Finding(
                    "driver",
                    f"{lib}.so",
                    "fail",
                    f"{where} has no usable {lib}.so.*{detail}",
                    f"install the host's user-space driver{' ' + module if module else ''} without the "
                    "kernel module (NVIDIA-Linux-x86_64-<version>.run --no-kernel-module, or the distro's "
                    "matching packages)",
                )
            )
        elif module is not None and loaded != module:
            findings.append(
                Finding(
                    "driver",
                    f"{lib}.so",
                    "fail",
                    f"{where}'s {lib}.so.{loaded} does not match the kernel module {module} ({source}): "
                    'NVML fails with "Driver/library version mismatch"',
                    f"install the {module} user-space driver in the container (same version as the host, "
                    "without the kernel module)",
                )
            )
        else:
            stale = [v for v in all_versions if v != loaded]
            status: Status = "warn" if stale else "ok"
            extra = f"; other versions on disk: {', '.join(stale)}" if stale else ""
            fix = f"remove the stale {lib}.so.{stale[0]} files" if stale else ""
            findings.append(
                Finding(
                    "driver",
                    f"{lib}.so",
                    status,
                    f"{lib}.so.{loaded} matches the kernel module {module}{extra}",
                    fix,
                )
            )
    findings.append(_torch_cuda(spec, ct, smi))
    findings.append(_torch_arch(spec, ct))
    return findings


def _torch_arch(spec: TargetSpec, ct: Mapping[str, Answer]) -> Finding:
    """The env's torch has kernels (cubins or PTX) for every GPU's compute capability."""
    name = "torch GPU architecture"
    answer = ct.get("env")
    try:
        manifest = json.loads(answer.output) if answer is not None and answer.exit_code == 0 else None
    except json.JSONDecodeError:
        manifest = None  # the torch CUDA build check names the unreadable manifest
    if not spec.env or not isinstance(manifest, dict) or not manifest.get("torch_cuda"):
        return Finding("driver", name, "skip", "no built env with a CUDA torch (the torch CUDA build check)")
    caps = ct.get("caps") or Answer(-1, "no answer")
    why, note = gpu_arch_problem(spec.env, manifest, {"exit_code": caps.exit_code, "output": caps.output})
    if why:
        cause, _, fix = why.partition("; lock ")
        return Finding("driver", name, "fail", cause, f"lock {fix}" if fix else "")
    if note:
        return Finding("driver", name, "warn", note, "`fab env-rebuild`" if "older fleet" in note else "")
    archs = " ".join(str(a) for a in manifest.get("torch_arch_list", []))
    return Finding("driver", name, "ok", f"torch {manifest.get('torch')} has kernels for every GPU ({archs})")


def _torch_cuda(spec: TargetSpec, ct: Mapping[str, Answer], smi: SmiXml | None) -> Finding:
    if not spec.env:
        return Finding("driver", "torch CUDA build", "skip", 'no managed env (env = ""): not checked')
    answer = ct.get("env")
    if answer is None or answer.exit_code != 0:
        return Finding(
            "driver", "torch CUDA build", "skip", f"env {spec.env} is not built yet (`fab deploy` builds it)"
        )
    try:
        manifest = json.loads(answer.output)
    except json.JSONDecodeError:
        return Finding(
            "driver",
            "torch CUDA build",
            "warn",
            f"env {spec.env}'s manifest is unreadable",
            "run `fab env-rebuild`",
        )
    torch, torch_cuda = str(manifest.get("torch", "")), str(manifest.get("torch_cuda", ""))
    if not torch:
        return Finding("driver", "torch CUDA build", "skip", f"env {spec.env} has no torch")
    if not torch_cuda or torch_cuda == "None":
        return Finding(
            "driver",
            "torch CUDA build",
            "fail",
            f"env {spec.env} has torch {torch}, a CPU-only build",
            f"lock a CUDA build of torch in envs/{spec.env} (see envs/README.md), then `fab env-rebuild`",
        )
    driver = None
    if smi is not None and smi.cuda_version and re.match(r"^\d+\.\d+", smi.cuda_version):
        major, minor = smi.cuda_version.split(".")[:2]
        driver = (int(major), int(minor))
    if driver is None:
        return Finding(
            "driver",
            "torch CUDA build",
            "warn",
            f"torch {torch} (CUDA {torch_cuda}): the driver's CUDA "
            "version is unknown (nvidia-smi -q -x gave none)",
            "check `nvidia-smi` on the host",
        )
    why = cuda_mismatch(torch_cuda, driver)
    if why:
        return Finding(
            "driver",
            "torch CUDA build",
            "fail",
            f"env {spec.env}: {why.split('; ')[0]}",
            why.split("; ", 1)[1] if "; " in why else "",
        )
    return Finding(
        "driver",
        "torch CUDA build",
        "ok",
        f"torch {torch} is built for CUDA {torch_cuda}, the driver supports {driver[0]}.{driver[1]}",
    )


def _nccl(
    spec: TargetSpec, ct: Mapping[str, Answer], ct_config: CtConfig | None, needs: RunNeeds
) -> list[Finding]:
    findings: list[Finding] = []
    where = spec.container.display if spec.container else spec.display
    on_gpu = spec.gpus > 0
    # /dev/shm
    shm = parse_df(answer_text(ct, "shm"))
    shm_fix = (
        'give the container a bigger /dev/shm, e.g. "lxc.mount.entry: tmpfs dev/shm tmpfs '
        'size=16G,nosuid,nodev,create=dir 0 0" in its config, then restart it'
        if spec.container
        else "remount /dev/shm bigger (`mount -o remount,size=16G /dev/shm`)"
    )
    if shm is None:
        findings.append(
            Finding(
                "nccl",
                "/dev/shm",
                "fail" if on_gpu else "warn",
                f"{where} has no /dev/shm (NCCL's shared-memory transport needs it)",
                shm_fix,
            )
        )
    elif shm[0] < SHM_MIN_BYTES:
        findings.append(
            Finding(
                "nccl",
                "/dev/shm",
                "fail" if on_gpu else "warn",
                f"/dev/shm in {where} is {_size(shm[0])}, NCCL and DataLoader workers need >= "
                f"{_size(SHM_MIN_BYTES)}",
                shm_fix,
            )
        )
    else:
        findings.append(Finding("nccl", "/dev/shm", "ok", f"{_size(shm[0])} ({_size(shm[1])} free)"))
    # ulimits
    limits = parse_keyed(answer_text(ct, "ulimit"))
    memlock = limits.get("memlock", "?")
    if memlock == "unlimited" or (memlock.isdigit() and int(memlock) >= MEMLOCK_MIN_KIB):
        findings.append(Finding("nccl", "ulimit -l", "ok", f"memlock {memlock}"))
    elif not on_gpu:
        findings.append(
            Finding("nccl", "ulimit -l", "skip", f"memlock {memlock} KiB; a CPU run does not use NCCL")
        )
    else:
        findings.append(
            Finding(
                "nccl",
                "ulimit -l",
                "warn",
                f"memlock is {memlock} KiB: NCCL over InfiniBand/RDMA cannot register its buffers "
                "(NVLink/PCIe within one host do not need it)",
                "raise the memlock limit to unlimited where fleet starts runs (the SSH session on the host: "
                "/etc/security/limits.conf `* - memlock unlimited`)",
            )
        )
    nofile = limits.get("nofile", "?")
    n = int(nofile) if nofile.isdigit() else (10**9 if nofile == "unlimited" else None)
    nofile_fix = (
        "raise nofile (`* - nofile 1048576` in /etc/security/limits.conf on the host, new SSH session)"
    )
    if n is None or n < NOFILE_FAIL:
        findings.append(
            Finding(
                "nccl",
                "ulimit -n",
                "fail",
                f"nofile is {nofile}: torch workers and NCCL run out of file descriptors",
                nofile_fix,
            )
        )
    elif n < NOFILE_WARN:
        findings.append(
            Finding("nccl", "ulimit -n", "warn", f"nofile is {nofile} (< {NOFILE_WARN})", nofile_fix)
        )
    else:
        findings.append(Finding("nccl", "ulimit -n", "ok", f"nofile {nofile}"))
    # hostname
    host = answer_text(ct, "hostname").strip() or "?"
    resolved = ct.get("resolve")
    if resolved is None or resolved.exit_code != 0 or not resolved.output.strip():
        findings.append(
            Finding(
                "nccl",
                "hostname",
                "fail",
                f"the hostname {host!r} of {where} does not resolve: torchrun's rendezvous hangs",
                f'add "127.0.1.1 {host}" to /etc/hosts in {where}',
            )
        )
    else:
        findings.append(Finding("nccl", "hostname", "ok", f"{host} resolves to {resolved.output.split()[0]}"))
    findings.append(_disk(spec, ct, needs))
    findings.append(_memory(spec, ct, ct_config, needs, where))
    return findings


def _disk(spec: TargetSpec, ct: Mapping[str, Answer], needs: RunNeeds) -> Finding:
    disk = parse_df(answer_text(ct, "disk"))
    if disk is None:
        return Finding(
            "nccl",
            "disk",
            "fail",
            f"cannot read the free space under {spec.workdir} "
            f"({tail_lines(ct.get('disk', Answer(1, '')).output, 1)})",
            f"create {spec.workdir} or fix targets.{spec.name}.workdir",
        )
    _, avail, mount = disk
    if not needs.known:
        need = COMPILE_CACHE_RESERVE
        what = (
            f"compile cache {_size(COMPILE_CACHE_RESERVE)} (run config {needs.config!r} not found here: "
            "checkpoints not estimated)"
        )
    else:
        env_missing = bool(spec.env) and "env" in ct and ct["env"].exit_code != 0
        ckpt = needs.checkpoint_bytes * (needs.keep_checkpoints + 1)
        need = ckpt + COMPILE_CACHE_RESERVE + (ENV_RESERVE if env_missing else 0)
        what = (
            f"{needs.keep_checkpoints}+1 checkpoints x {_size(needs.checkpoint_bytes)} "
            f"({_count(needs.drafter_params)} drafter params x {CHECKPOINT_BYTES_PER_PARAM} B)"
            " + compile cache "
            f"{_size(COMPILE_CACHE_RESERVE)}" + (f" + env {_size(ENV_RESERVE)}" if env_missing else "")
        )
    if avail < need:
        return Finding(
            "nccl",
            "disk",
            "fail",
            f"{_size(avail)} free on {mount} (workdir {spec.workdir}), the run needs ~{_size(need)}: {what}",
            f"free space on {mount} or move the workdir to a bigger volume",
        )
    return Finding("nccl", "disk", "ok", f"{_size(avail)} free on {mount}, needs ~{_size(need)} ({what})")


def _memory(
    spec: TargetSpec, ct: Mapping[str, Answer], ct_config: CtConfig | None, needs: RunNeeds, where: str
) -> Finding:
    limit = memory_limit(ct_config, answer_text(ct, "memory"))
    if limit is None:
        return Finding("nccl", "memory", "warn", f"cannot read the memory limit of {where}", "")
    limit_bytes, source = limit
    if not needs.known:
        return Finding(
            "nccl",
            "memory",
            "skip",
            f"{_size(limit_bytes)} ({source}); run config {needs.config!r} not found here: "
            "need not estimated",
        )
    ranks = max(spec.gpus, 1)
    # A pretrained target is read through host memory (page cache); on CPU the model lives there.
    model = needs.target_bytes or 0
    host_model = model if (needs.kind == "pretrained" or spec.gpus == 0) else 0
    need = host_model + ranks * RANK_OVERHEAD
    fix_where = (
        f"`pct set {spec.container.id} -memory <MiB>`"
        if spec.container and spec.container.type == "pct"
        else "more memory"
    )
    if needs.kind == "pretrained" and needs.target_bytes is None:
        return Finding(
            "nccl",
            "memory",
            "fail" if needs.model_path else "warn",
            f"the target model {needs.model_path or '(model.path unset)'} is not readable in {where}",
            "copy the model folder there or fix --model.path",
        )
    detail = f"{ranks} process(es) x {_size(RANK_OVERHEAD)}"
    detail = (
        f"target weights {_size(host_model)} + {detail}"
        if host_model
        else f"{detail}; the target is built on the GPU"
    )
    if limit_bytes < need:
        return Finding(
            "nccl",
            "memory",
            "fail",
            f"memory limit {_size(limit_bytes)} ({source}) < ~{_size(need)} needed ({detail})",
            f"raise it: {fix_where}",
        )
    return Finding("nccl", "memory", "ok", f"{_size(limit_bytes)} ({source}) >= ~{_size(need)} ({detail})")


def gpu_roles(spec: TargetSpec) -> tuple[list[int], list[int]]:
    if spec.topology is None:
        return [], []
    targets = list(range(spec.topology.targets))
    return targets, list(range(spec.topology.targets, spec.topology.world_size))


def _host_index(spec: TargetSpec, facts: Facts, smi: SmiXml | None) -> dict[int, int]:
    """Container GPU index -> host GPU index: the container numbers the GPUs it was given (its
    /dev/nvidiaN minors) in PCI bus order, as the host does."""
    if facts.host is None or smi is None:
        return {i: i for i in range(spec.gpus)}
    minors = sorted(
        n.minor
        for p, n in parse_nodes(answer_text(facts.container, "nodes")).items()
        if GPU_NODE_RE.match(p) and n.minor is not None
    )
    by_minor = {g.minor: g for g in smi.gpus if g.minor is not None}
    given = [by_minor[m] for m in minors if m in by_minor]
    if len(given) != len(minors) or not given:
        return {i: i for i in range(spec.gpus)}
    ordered = sorted(given, key=lambda g: g.bus_id or "")
    return {i: g.index for i, g in enumerate(ordered)}


def _topology(spec: TargetSpec, facts: Facts, smi: SmiXml | None) -> list[Finding]:
    targets, drafters = gpu_roles(spec)
    if not targets:
        return [Finding("topology", "target <-> drafter links", "skip", "no N+M topology configured")]
    parts = facts.host if facts.host is not None else facts.container
    topo, p2p = (parts or {}).get("topo"), (parts or {}).get("p2p")
    if topo is None or topo.exit_code != 0:
        why = tail_lines(topo.output, 1) if topo else "not run"
        return [
            Finding(
                "topology",
                "target <-> drafter links",
                "warn",
                f"`nvidia-smi topo -m` failed: {why}",
                "run `fab doctor --bandwidth` to measure the link instead",
            )
        ]
    links = parse_gpu_matrix(topo.output)
    p2p_cells = parse_gpu_matrix(p2p.output) if p2p is not None and p2p.exit_code == 0 else {}
    index = _host_index(spec, facts, smi)
    pairs = [(t, d) for t in targets for d in drafters]
    kinds: dict[str, int] = {}
    no_p2p = []
    for t, d in pairs:
        ht, hd = index.get(t, t), index.get(d, d)
        link = links.get((ht, hd), "?")
        kinds[link] = kinds.get(link, 0) + 1
        status = p2p_cells.get((ht, hd))
        if p2p_cells and status != "OK":
            no_p2p.append(f"GPU{ht}<->GPU{hd}: {status or '?'} over {link}")
    summary = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
    roles = f"targets {_span(targets)} <-> drafters {_span(drafters)}"
    if no_p2p:
        return [
            Finding(
                "topology",
                "P2P target <-> drafter",
                "warn",
                f"{roles}: no GPU peer-to-peer for {len(no_p2p)}/{len(pairs)} pair(s) "
                f"({'; '.join(no_p2p[:4])}): "
                "NCCL stages the hidden states through host memory",
                "measure what the run gets with `fab doctor --bandwidth`; a box with NVLink or P2P-capable "
                "GPUs avoids it",
            )
        ]
    p2p_note = "P2P read OK" if p2p_cells else "P2P status unknown (`topo -p2p r` gave none)"
    return [Finding("topology", "target <-> drafter links", "ok", f"{roles}: {summary}; {p2p_note}")]


def _span(ids: Sequence[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _health(spec: TargetSpec, facts: Facts, smi: SmiXml | None) -> list[Finding]:
    if smi is None:
        parts = facts.host if facts.host is not None else facts.container
        answer = (parts or {}).get("smi_xml")
        why = smi_failure(answer, spec.commands.nvidia_smi) if answer is not None else None
        return [
            Finding(
                "health",
                "GPU clocks and health",
                "fail" if why else "warn",
                f"`nvidia-smi -q -x` gave no answer: {why or 'not run'}",
                "check `nvidia-smi` on the host",
            )
        ]
    findings = []
    for gpu in smi.gpus:
        problems: list[tuple[Status, str, str]] = []
        if gpu.persistence is False:
            problems.append(
                (
                    "warn",
                    "persistence mode off (each process pays the driver start-up, the GPU may "
                    "reset its clocks)",
                    "`nvidia-smi -pm 1` on the host, or enable nvidia-persistenced",
                )
            )
        if gpu.slowdowns:
            problems.append(
                (
                    "warn",
                    f"clocks held back: {', '.join(gpu.slowdowns)}",
                    "check cooling and power limits (`nvidia-smi -q -d PERFORMANCE` on the host)",
                )
            )
        if gpu.ecc_enabled is False:
            problems.append(
                ("warn", "ECC is off", "`nvidia-smi -e 1` on the host and reboot, if the GPU supports it")
            )
        if gpu.ecc_uncorrected:
            problems.append(
                (
                    "fail",
                    f"{gpu.ecc_uncorrected} uncorrected volatile ECC error(s)",
                    "reset the GPU (`nvidia-smi -r`) or reboot the host",
                )
            )
        h = gpu.health
        if h is not None and h.remap_failure:
            problems.append(("fail", "row remapping failed", "the GPU needs service"))
        if h is not None and (h.remap_pending or h.retirement_pending):
            problems.append(
                ("fail", "remapped rows / page retirement pending", "reset the GPU to apply them")
            )
        state = (
            f"persistence {'on' if gpu.persistence else 'off' if gpu.persistence is False else '?'}, "
            f"ECC {'on' if gpu.ecc_enabled else 'off' if gpu.ecc_enabled is False else '?'}, "
            f"{gpu.ecc_uncorrected or 0} uncorrected, "
            f"{'slowdown: ' + ', '.join(gpu.slowdowns) if gpu.slowdowns else 'no slowdown'}"
        )
        check = f"GPU {gpu.index} ({gpu.name})"
        if not problems:
            findings.append(Finding("health", check, "ok", state))
        else:
            worst: Status = "fail" if any(p[0] == "fail" for p in problems) else "warn"
            findings.append(
                Finding(
                    "health",
                    check,
                    worst,
                    "; ".join(p[1] for p in problems),
                    "; ".join(p[2] for p in problems),
                )
            )
    return findings


def _bandwidth_finding(bw: Bandwidth) -> Finding:
    devices = " -> ".join(bw.devices)
    measured = f"{bw.gb_per_s:.1f} GB/s ({bw.backend}, {devices}, {_size(bw.bytes)} x {bw.iterations})"
    if bw.backend != "nccl" or bw.need_gb_per_s is None:
        return Finding("bandwidth", "send/recv", "ok", f"{measured}: CPU processes over gloo, not a GPU link")
    need = (
        f"the run needs {bw.need_gb_per_s:.2f} GB/s ({bw.hidden_bytes_per_token} B of hidden states "
        "per token x "
        f"{bw.tokens_per_s:,.0f} tokens/s)"
    )
    if bw.gb_per_s < bw.need_gb_per_s:
        return Finding(
            "bandwidth",
            "send/recv",
            "fail",
            f"{measured} < {need}",
            "use GPUs with NVLink / P2P between targets and drafters, or plan fewer tokens/s",
        )
    return Finding("bandwidth", "send/recv", "ok", f"{measured} >= {need}")
