"""The clean-GPU gate: nvidia-smi parsers (pure), checks, the report, and the gate before a launch.

One remote command per location gathers everything (``probe``): ``--query-gpu``,
``--query-compute-apps``, ``-q -x`` (retired pages, remapped rows) and ``ps`` for the
PIDs the driver names. The NVIDIA driver ignores PID namespaces, so for a target with a
container the process/memory/health checks run on the host (``where="host"``) and only
visibility (count, names, NVML working) is checked inside the container. Nothing is
ever killed: the report names the PIDs and says what to do.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass
from io import StringIO
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fleet import remote
from fleet.errors import FleetError, GpuGateError
from fleet.remote import Answer

if TYPE_CHECKING:
    from fleet.inventory import TargetSpec
    from fleet.target import Target, Where

QUERY_FIELDS = (
    "index", "uuid", "name", "pci.bus_id", "driver_version", "pstate", "memory.total", "memory.used",
    "memory.free", "utilization.gpu", "temperature.gpu", "power.draw",
    "ecc.errors.uncorrected.volatile.total", "compute_mode",
)  # fmt: skip
APPS_FIELDS = ("pid", "gpu_uuid", "process_name", "used_gpu_memory")
CPU_LINE = "no GPUs configured: running on CPU"

# --- parsed data ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    """One row of ``--query-gpu``; ``None`` where nvidia-smi said ``[N/A]`` / ``[Not Supported]``."""

    index: int
    uuid: str
    name: str
    bus_id: str | None
    driver_version: str | None
    pstate: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    utilization_pct: int | None
    temperature_c: int | None
    power_w: float | None
    ecc_uncorrected_volatile: int | None
    compute_mode: str | None


@dataclass(frozen=True)
class GpuQuery:
    """All of ``--query-gpu``: the GPUs, and the lines about GPUs nvidia-smi could not read."""

    gpus: tuple[GpuInfo, ...]
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class ComputeApp:
    """One row of ``--query-compute-apps``."""

    pid: int
    gpu_uuid: str
    process_name: str | None
    used_memory_mib: int | None


@dataclass(frozen=True)
class GpuHealth:
    """Retired pages / remapped rows of one GPU from ``-q -x`` (``None``: not reported)."""

    uuid: str
    retirement_pending: bool | None
    remap_pending: bool | None
    remap_failure: bool | None
    remapped_uncorrectable: int | None


@dataclass(frozen=True)
class ProcessInfo:
    """A PID as ``ps -o pid=,pgid=,user=,args=`` shows it."""

    pid: int
    pgid: int
    user: str
    args: str


@dataclass(frozen=True)
class Probe:
    """Everything one location answered (``remote/gpu_probe.sh``); absent parts are ``None``."""

    where: str
    query: Answer
    apps: Answer | None = None
    xml: Answer | None = None
    ps: Answer | None = None
    run_ids: str | None = None  # the latest run's recorded pid and pgid files


# --- pure parsers ----------------------------------------------------------------------------------


def _value(raw: str) -> str | None:
    text = raw.strip()
    if not text or text == "N/A" or (text.startswith("[") and text.endswith("]")):
        return None
    return text


def _number(raw: str | None) -> float | None:
    if raw is None:
        return None
    head = raw.split()[0]
    try:
        return float(head)
    except ValueError:
        raise GpuGateError(f"nvidia-smi printed {raw!r} where a number was expected") from None


def _int(raw: str | None) -> int | None:
    number = _number(raw)
    return None if number is None else round(number)


def _rows(text: str, what: str) -> tuple[list[str], list[list[str]], list[str]]:
    """CSV header (units stripped), data rows, and lines that are not rows (messages)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise GpuGateError(f"nvidia-smi {what} printed nothing")
    header = [name.split(" [")[0].strip() for name in lines[0].split(",")]
    if not header or header[0] not in ("index", "pid"):
        raise GpuGateError(f"nvidia-smi {what} printed no CSV header: {lines[0][:120]!r}")
    rows, other = [], []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split(", ")]
        if len(cells) == len(header):
            rows.append(cells)
        else:
            other.append(line.strip())
    return header, rows, other


def parse_query_gpu(text: str) -> GpuQuery:
    """Parse ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv``."""
    header, rows, other = _rows(text, "--query-gpu")
    missing = [name for name in QUERY_FIELDS if name not in header]
    if missing:
        raise GpuGateError(f"nvidia-smi --query-gpu output lacks {', '.join(missing)}")
    for line in other:
        if "device handle" not in line and "GPU is lost" not in line:
            raise GpuGateError(f"unexpected line in nvidia-smi --query-gpu output: {line[:120]!r}")
    gpus = []
    for cells in rows:
        row = dict(zip(header, (_value(c) for c in cells), strict=True))
        index = _int(row["index"])
        if index is None or row["uuid"] is None:
            raise GpuGateError(f"nvidia-smi --query-gpu row without index/uuid: {', '.join(cells)[:120]!r}")
        gpus.append(
            GpuInfo(
                index=index,
                uuid=row["uuid"],
                name=row["name"] or "?",
                bus_id=row["pci.bus_id"],
                driver_version=row["driver_version"],
                pstate=row["pstate"],
                memory_total_mib=_int(row["memory.total"]),
                memory_used_mib=_int(row["memory.used"]),
                memory_free_mib=_int(row["memory.free"]),
                utilization_pct=_int(row["utilization.gpu"]),
                temperature_c=_int(row["temperature.gpu"]),
                power_w=_number(row["power.draw"]),
                ecc_uncorrected_volatile=_int(row["ecc.errors.uncorrected.volatile.total"]),
                compute_mode=row["compute_mode"],
            )
        )
    return GpuQuery(tuple(gpus), tuple(other))


def parse_compute_apps(text: str) -> tuple[ComputeApp, ...]:
    """Parse ``nvidia-smi --query-compute-apps=<APPS_FIELDS> --format=csv`` (header only: none)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if "No devices were found" in text:
        return ()
    if not lines or not lines[0].startswith("pid"):
        raise GpuGateError(f"nvidia-smi --query-compute-apps printed no CSV header: {text.strip()[:120]!r}")
    apps = []
    for line in lines[1:]:
        pid_text, _, rest = line.partition(",")
        uuid, _, rest = rest.partition(",")
        name, _, memory = rest.rpartition(",")  # a process name may contain commas
        pid = _int(_value(pid_text))
        if pid is None or not uuid.strip():
            raise GpuGateError(f"unexpected line in nvidia-smi --query-compute-apps output: {line[:120]!r}")
        apps.append(ComputeApp(pid, uuid.strip(), _value(name), _int(_value(memory))))
    return tuple(apps)


def _yes_no(text: str | None) -> bool | None:
    value = _value(text or "")
    return None if value is None else value.lower() == "yes"


def parse_health_xml(text: str) -> tuple[GpuHealth, ...]:
    """Retired pages and remapped rows per GPU from ``nvidia-smi -q -x``."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise GpuGateError(f"nvidia-smi -q -x printed invalid XML ({err})") from None
    health = []
    for gpu in root.iter("gpu"):
        health.append(
            GpuHealth(
                uuid=(gpu.findtext("uuid") or "").strip(),
                retirement_pending=_yes_no(gpu.findtext("retired_pages/pending_retirement")),
                remap_pending=_yes_no(gpu.findtext("remapped_rows/remapped_row_pending")),
                remap_failure=_yes_no(gpu.findtext("remapped_rows/remapped_row_failure")),
                remapped_uncorrectable=_int(_value(gpu.findtext("remapped_rows/remapped_row_unc") or "")),
            )
        )
    return tuple(health)


def parse_ps(text: str) -> dict[int, ProcessInfo]:
    """Parse ``ps -ww -o pid=,pgid=,user=,args=`` lines (error lines are skipped)."""
    found = {}
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            pid = int(parts[0])
            found[pid] = ProcessInfo(pid, int(parts[1]), parts[2], parts[3] if len(parts) > 3 else "")
    return found


def parse_probe(text: str, where: str) -> Probe:
    """``remote/gpu_probe.sh``'s answers (``remote.parse_answers``) as a :class:`Probe`."""
    parts = remote.parse_answers(text)
    if "query" not in parts:
        raise GpuGateError(f"{where}: the GPU probe printed no nvidia-smi answer: {text.strip()[:160]!r}")
    ids = parts["runids"].output if "runids" in parts else None
    return Probe(where, parts["query"], parts.get("apps"), parts.get("xml"), parts.get("ps"), ids)


def smi_failure(answer: Answer, nvidia_smi: str, timeout_s: float | None = None) -> str | None:
    """Why an nvidia-smi call gave no usable answer, in words; ``None`` when it answered."""
    text = answer.output
    if answer.exit_code in (124, 137):  # timeout(1): TERM, then KILL
        within = f"{timeout_s:g}s" if timeout_s else "the timeout"
        return f"nvidia-smi did not answer within {within} (a hung driver or GPU? check `dmesg` for Xid)"
    if answer.exit_code in (126, 127) or ("not found" in text.lower() and answer.exit_code != 0):
        return f"`{nvidia_smi}` not found (install the NVIDIA driver utilities or set commands.nvidia_smi)"
    if "version mismatch" in text.lower():
        return (
            "NVML driver/library version mismatch: the loaded kernel module and the user-space library "
            "differ (a driver update without a reboot?); reboot or reload the nvidia module"
        )
    if "No devices were found" in text:
        return None
    if "couldn't communicate with the NVIDIA driver" in text:
        return "nvidia-smi cannot talk to the NVIDIA driver (not loaded?): check `lsmod | grep nvidia`"
    if answer.exit_code != 0:
        return f"nvidia-smi exited {answer.exit_code}: {' '.join(text.split())[:200]}"
    return None


# --- checks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, with what the host knows about it."""

    pid: int
    gpu_index: int
    name: str | None
    used_memory_mib: int | None
    user: str | None = None
    args: str | None = None
    ours: bool = False  # this project's run (its run dir, or the recorded pid/pgid)


@dataclass(frozen=True)
class GpuVerdict:
    """One GPU: its numbers, its processes, and why it is not clean (no reasons: clean)."""

    index: int
    uuid: str
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None
    processes: tuple[GpuProcess, ...]
    reasons: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class GateReport:
    """The gate's verdict for one target."""

    target: str
    expected_gpus: int
    gpus: tuple[GpuVerdict, ...] = ()
    problems: tuple[str, ...] = ()  # target-wide: count, nvidia-smi failures
    notes: tuple[str, ...] = ()  # informational, never block

    @property
    def clean(self) -> bool:
        return not self.problems and all(g.clean for g in self.gpus)

    @property
    def processes(self) -> tuple[GpuProcess, ...]:
        return tuple(p for g in self.gpus for p in g.processes)

    def summary(self) -> str:
        """One line: every reason, with its GPU."""
        parts = list(self.problems)
        parts += [f"GPU {g.index}: {r}" for g in self.gpus for r in g.reasons]
        return "; ".join(parts) if parts else f"{len(self.gpus)} GPU(s) clean"

    def text(self, width: int = 120) -> str:
        """A rich table per GPU, then the reasons, the PIDs' owners and the overall verdict."""
        out = Console(file=StringIO(), width=width, color_system=None, markup=False, highlight=False)
        if self.gpus:
            table = Table(title=f"GPUs of {self.target}", title_justify="left")
            for column in ("GPU", "name", "memory used/total", "util", "processes", "verdict"):
                table.add_column(column)
            for g in self.gpus:
                pids = ", ".join(f"{p.pid} {p.name or '?'}" for p in g.processes) or "-"
                util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
                memory = f"{_mib(g.memory_used_mib)} / {_mib(g.memory_total_mib)}"
                table.add_row(str(g.index), g.name, memory, util, pids, "clean" if g.clean else "NOT CLEAN")
            out.print(table)
        for p in self.processes:
            owner = f"{p.user}: {p.args}" if p.args else "no such process for ps (another PID namespace?)"
            out.print(f"PID {p.pid} on GPU {p.gpu_index}{' (this project run)' if p.ours else ''}: {owner}")
        lines = [*self.notes, *self.problems, *(f"GPU {g.index}: {r}" for g in self.gpus for r in g.reasons)]
        for line in [*lines, f"{self.target}: {'CLEAN' if self.clean else 'NOT CLEAN'}"]:
            out.print(line)
        return out.file.getvalue()  # type: ignore[attr-defined]

    def to_json(self) -> str:
        data = asdict(self)
        data["clean"] = self.clean
        for gpu, verdict in zip(data["gpus"], self.gpus, strict=True):
            gpu["clean"] = verdict.clean
        return json.dumps(data, indent=2)


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value} MiB"


def evaluate(spec: TargetSpec, visible: Probe, host: Probe | None = None) -> GateReport:
    """The verdict from what the container (``visible``) and the host answered (``None``: no container)."""
    host = host or visible
    smi = spec.commands.nvidia_smi
    expected = spec.gpus
    failure = smi_failure(visible.query, smi, spec.gpu_gate.timeout_s)
    if failure:
        return GateReport(spec.name, expected, problems=(f"{visible.where}: {failure}",))
    no_devices = "No devices were found" in visible.query.output  # exit 6: zero GPUs, checked below
    query = GpuQuery(()) if no_devices else parse_query_gpu(visible.query.output)
    problems = [f"{visible.where}: {line}" for line in query.lost]
    topo = f" (topology {spec.topology})" if spec.topology else ""
    if len(query.gpus) != expected:
        problems.append(
            f"{visible.where} sees {len(query.gpus)} GPU(s), expected {expected} "
            f"(targets.{spec.name}.gpus{topo}): a GPU is missing or not passed through"
        )
    host_gpus = {g.uuid: g for g in query.gpus}
    notes: list[str] = []
    if host is not visible:
        host_failure = smi_failure(host.query, smi, spec.gpu_gate.timeout_s)
        if host_failure:
            problems.append(f"{host.where}: {host_failure}")
            host_gpus = {}
        else:
            host_gpus = {g.uuid: g for g in parse_query_gpu(host.query.output).gpus}
    apps: tuple[ComputeApp, ...] = ()
    if host.apps is not None and (apps_failure := smi_failure(host.apps, smi, spec.gpu_gate.timeout_s)):
        problems.append(f"{host.where}: process list unavailable: {apps_failure}")
    elif host.apps is not None:
        apps = parse_compute_apps(host.apps.output)
    health: dict[str, GpuHealth] = {}
    if host.xml is not None and host.xml.exit_code == 0:
        health = {h.uuid: h for h in parse_health_xml(host.xml.output)}
    elif query.gpus:
        notes.append(f"{host.where}: retired pages / remapped rows not reported (`nvidia-smi -q -x` failed)")
    procs = parse_ps(host.ps.output) if host.ps else {}
    recorded = {int(w) for w in (visible.run_ids or "").split() if w.isdigit() and int(w) > 1}
    recorded = recorded if host is visible else set()  # a container's pids are not the host's
    runs_prefix = spec.layout.runs.rstrip("/") + "/"
    verdicts = []
    for gpu in query.gpus:
        own = []
        for app in (a for a in apps if a.gpu_uuid == gpu.uuid):
            info = procs.get(app.pid)
            ours = info is not None and (runs_prefix in info.args or bool({info.pid, info.pgid} & recorded))
            user, args = (info.user, info.args) if info else (None, None)
            own.append(
                GpuProcess(app.pid, gpu.index, app.process_name, app.used_memory_mib, user, args, ours)
            )
        reasons = []
        if spec.gpu_gate.expected_name and spec.gpu_gate.expected_name not in gpu.name:
            reasons.append(f"is {gpu.name!r}, expected {spec.gpu_gate.expected_name!r}")
        seen = host_gpus.get(gpu.uuid)
        if seen is None:
            reasons.append(f"{gpu.uuid} not found by {host.where}'s nvidia-smi")
        else:
            reasons += _gpu_reasons(seen, own, health.get(gpu.uuid), spec.gpu_gate.max_memory_mib)
        shown = seen or gpu
        verdicts.append(
            GpuVerdict(
                gpu.index,
                gpu.uuid,
                gpu.name,
                shown.memory_used_mib,
                shown.memory_total_mib,
                shown.utilization_pct,
                tuple(own),
                tuple(reasons),
            )
        )
    return GateReport(spec.name, expected, tuple(verdicts), tuple(problems), tuple(notes))


def _gpu_reasons(gpu: GpuInfo, procs: list[GpuProcess], health: GpuHealth | None, max_mib: int) -> list[str]:
    reasons = []
    for p in procs:
        used = "" if p.used_memory_mib is None else f", {p.used_memory_mib} MiB"
        reasons.append(f"compute process PID {p.pid} ({p.name or '?'}{used})")
    if gpu.memory_used_mib is None:
        reasons.append("memory.used not reported: cannot verify it is free")
    elif gpu.memory_used_mib > max_mib and not procs:
        reasons.append(
            f"{gpu.memory_used_mib} MiB in use with no owning process (over {max_mib} MiB): a zombie CUDA "
            "context (a process that died, or one in a PID namespace nvidia-smi cannot see)"
        )
    if gpu.ecc_uncorrected_volatile:
        reasons.append(f"{gpu.ecc_uncorrected_volatile} uncorrected volatile ECC error(s): reset the GPU")
    if health is not None:
        if health.remap_failure:
            reasons.append("row remapping failed: the GPU needs service")
        if health.remap_pending:
            reasons.append("remapped rows pending: reset the GPU to apply them")
        if health.retirement_pending:
            reasons.append("page retirement pending: reset the GPU to retire them")
    return reasons


# --- on a target -----------------------------------------------------------------------------------


def _probe(target: Target, where: Where, parts: str, latest_run: str) -> Probe:
    spec = target.spec
    timeout = spec.gpu_gate.timeout_s
    fields = ",".join(QUERY_FIELDS), ",".join(APPS_FIELDS)
    argv = remote.sh("gpu_probe.sh", f"{timeout:g}", spec.commands.nvidia_smi, *fields, parts, latest_run)
    result = target.run(argv, check=True, timeout=3 * (timeout + 2) + 30, where=where)
    label = "host" if where == "host" else spec.container.display if spec.container else spec.display
    return parse_probe(result.stdout, label)


def check_gpus(target: Target) -> GateReport:
    """Probe ``target`` (one command per location) and evaluate; a CPU target runs nothing."""
    spec = target.spec
    if spec.gpus == 0:
        return GateReport(spec.name, 0, notes=(CPU_LINE,))
    latest_run = spec.layout.latest_run
    if spec.container is None:
        return evaluate(spec, _probe(target, "container", "query apps xml", latest_run))
    visible = _probe(target, "container", "query", latest_run)
    host = _probe(target, "host", "query apps xml", "")
    return evaluate(spec, visible, host)


def wait_clean(
    target: Target,
    wait_s: float,
    *,
    interval_s: float = 5.0,
    on_poll: Callable[[GateReport], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> GateReport:
    """Check until clean or ``wait_s`` has passed; returns the last report."""
    deadline = clock() + wait_s
    while True:
        report = check_gpus(target)
        if report.clean or clock() >= deadline:
            return report
        if on_poll is not None:
            on_poll(report)
        sleep(max(0.0, min(interval_s, deadline - clock())))


def gate_message(report: GateReport) -> str:
    """The one-line refusal: what is in the way, and what to do (nothing is killed)."""
    ours = [p.pid for p in report.processes if p.ours]
    advice = []
    if ours:
        advice.append(f"PID {', '.join(map(str, ours))} is this project's run: stop it with `fab stop`")
    if any(g.reasons for g in report.gpus):
        advice.append("wait for the GPUs with `fab gpus --wait 600`")
    else:
        advice.append("fix that, then check with `fab gpus`")
    pids = [p.pid for p in report.processes]
    held = f" (PIDs {', '.join(map(str, pids))})" if pids else ""
    return (
        f"{report.target}: GPUs not clean{held}, not launching: {report.summary()}; "
        f"{'; or '.join(advice)}. Nothing was killed."
    )


def gate(target: Target, echo: Callable[[str], None] = print) -> GateReport:
    """The check before a launch: returns the report when clean, else raises ``GpuGateError``."""
    report = check_gpus(target)
    if target.spec.gpus == 0:
        echo(CPU_LINE)
        return report
    if not report.clean:
        raise GpuGateError(gate_message(report))
    echo(f"{report.target}: {report.summary()}")
    return report


def gpus_task(target: Target, *, wait_s: float = 0.0, as_json: bool = False) -> str:
    """``fab gpus``: the report (text or JSON); prints it and raises ``FleetError`` (exit 1) if not clean."""

    def waiting(report: GateReport) -> None:
        print(f"{report.target}: waiting for clean GPUs: {report.summary()}", file=sys.stderr, flush=True)

    report = wait_clean(target, wait_s, on_poll=waiting) if wait_s > 0 else check_gpus(target)
    out = report.to_json() if as_json else report.text()
    if report.clean:
        return out
    print(out.rstrip("\n"), flush=True)
    waited = f" after waiting {wait_s:g}s" if wait_s > 0 else ""
    raise FleetError(f"{report.target}: GPUs not clean{waited}: {report.summary()}")
