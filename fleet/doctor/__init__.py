"""`fab doctor`: is this target (a Proxmox LXC container, or a machine) fit to train, before a launch.

Read-only. Two round trips at most, one script per location (``fleet/remote/doctor_host.sh`` on
the Proxmox host of a container target, ``fleet/remote/doctor_container.sh`` where the run will
run), plus one more for ``--bandwidth`` (``fleet/remote/doctor_bandwidth.py``, run by the env's
own python). Their output is parsed by the pure parsers below, tested on recorded real output,
and judged by :func:`evaluate` (pure) into a :class:`DoctorReport`: one :class:`Finding` per check,
each one line naming what is wrong and the fix; any ``fail`` makes ``fab doctor`` exit 1.

What is checked (docs/doctor.md "`fab doctor` (`fleet.doctor`)" has the thresholds):

- passthrough: the container config (``pct config <id>``) has the ``lxc.cgroup2.devices.allow``
  and ``lxc.mount.entry`` lines (or ``devN:`` entries) for every ``/dev/nvidiaN``, ``nvidiactl``,
  ``nvidia-uvm``, ``nvidia-uvm-tools`` and ``nvidia-caps``; the container has the device nodes;
  their count matches ``gpus``;
- driver: the host's kernel module (``/proc/driver/nvidia/version``) against the container's
  ``libnvidia-ml.so.*`` / ``libcuda.so.*`` (NVML's "Driver/library version mismatch"), and the
  env's torch CUDA build against the driver's CUDA version (``fleet.envs.cuda_mismatch``);
- what NCCL and torchrun need: ``/dev/shm``, ``ulimit -l``, ``ulimit -n``, the hostname resolving,
  free disk in the workdir for checkpoints + compile cache (+ the env), memory for the target;
- how the GPUs talk: ``nvidia-smi topo -m`` and ``topo -p2p r`` between the topology's target and
  drafter GPUs, and with ``--bandwidth`` a measured send/recv of one batch of hidden states;
- clocks and health per GPU: persistence mode, clock event (throttle) reasons, ECC, retired pages /
  remapped rows (``fleet.gpus.parse_health_xml``).

A target with ``gpus = 0`` runs the checks that apply and lists the GPU ones as not applying.

The package: ``parse`` (pure parsers, thresholds), ``needs`` (the run's sizes, from the run config the
inventory loaded), ``checks`` (the verdict, pure: the table of checks) and here the task (the probe on
a target, the bandwidth measurement, ``fab doctor``).
"""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Any

from fleet import remote, runs
from fleet.doctor.checks import Bandwidth, DoctorReport, Facts, Finding, answer_text, evaluate, gpu_roles
from fleet.doctor.needs import RunNeeds, run_needs
from fleet.doctor.parse import (
    DEFAULT_TOKENS_PER_S,
    dev_entries,
    memory_limit,
    mounted_paths,
    parse_ct_config,
    parse_device_rules,
    parse_df,
    parse_gpu_matrix,
    parse_libs,
    parse_module_version,
    parse_smi_xml,
)
from fleet.errors import FleetError, tail_lines

if TYPE_CHECKING:
    from fleet.target import Target


# --- on a target ---------------------------------------------------------------------------------------


def probe(target: Target, needs_model: str = "") -> Facts:
    """Run the doctor scripts: on the host (container targets), then where the run runs."""
    spec = target.spec
    timeout = f"{spec.gpu_gate.timeout_s:g}"
    smi = spec.commands.nvidia_smi
    budget = 4 * spec.gpu_gate.timeout_s + 60
    host = None
    if spec.container is not None:
        ct_id = str(spec.container.id) if spec.container.type == "pct" else str(spec.container.name)
        argv = remote.sh(
            "doctor_host.sh",
            spec.container.type,
            ct_id,
            spec.commands.pct,
            smi,
            timeout,
            "1" if spec.gpus > 0 else "0",
        )
        host = remote.parse_answers(target.run(argv, timeout=budget, where="host").stdout)
    manifest = (
        posixpath.join(spec.layout.env_current(spec.env), "fleet-env", "manifest.json") if spec.env else ""
    )
    gpu = "none" if spec.gpus == 0 else ("ct" if spec.container is not None else "all")
    argv = remote.sh("doctor_container.sh", smi, timeout, spec.workdir, manifest, needs_model, gpu)
    container = remote.parse_answers(target.run(argv, timeout=budget).stdout)
    return Facts(container, host)


def measure_bandwidth(
    target: Target, needs: RunNeeds, tokens_per_s: float, timeout_s: float = 600
) -> Bandwidth | Finding:
    """``fleet/remote/doctor_bandwidth.py`` in the target's env: one target rank sends a batch of hidden
    states to one drafter rank (NCCL between the two GPUs; gloo between two CPU processes). A probe
    that cannot run is a failed :class:`Finding` (the rest of the report still stands)."""
    spec = target.spec
    if spec.gpus == 1:
        return Finding(
            "bandwidth", "send/recv", "skip", "gpus = 1: a send/recv needs a target and a drafter GPU"
        )
    targets, drafters = gpu_roles(spec)
    t_gpu, d_gpu = (targets[0], drafters[0]) if targets else (0, 1)
    per_token = needs.hidden_bytes_per_token if needs.known else 5 * 5120 * 2
    size = needs.batch_hidden_bytes if needs.known else 65536 * per_token
    args = ["--bytes", str(size), "--timeout", f"{timeout_s:g}"]
    args += ["--gpus", f"{t_gpu},{d_gpu}"] if spec.gpus > 0 else ["--cpu"]
    # The run's own environment (e.g. NCCL_* settings of the inventory's run.env) on stdin, as for
    # the run itself: never in argv (`ps`); the probe is the `-c` program (nothing is deployed).
    argv = [spec.run_python, "-I", "-c", remote.script("doctor_bandwidth.py"), *args]
    res = runs.run_with_env(target, argv, in_current=False, timeout=timeout_s + 60)
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        data = {}
    if res.exit_code != 0 or "gb_per_s" not in data:
        why = data.get("error") or tail_lines(res.stderr or res.stdout, 2) or f"exit {res.exit_code}"
        if res.exit_code in (126, 127):
            return Finding("bandwidth", "send/recv", "fail", f"{spec.run_python} does not run ({why})",
                           "`fab deploy` builds the env")  # fmt: skip
        fix = (
            f"install torch in {spec.run_python} or use a managed env (targets.{spec.name}.env)"
            if "No module named 'torch'" in why
            else f"NCCL_DEBUG=INFO in targets.{spec.name}.run.env shows why NCCL failed"
        )
        return Finding("bandwidth", "send/recv", "fail", f"the probe failed ({spec.run_python}): {why}", fix)
    need = per_token * tokens_per_s / 1e9 if spec.gpus > 0 else None
    return Bandwidth(
        backend=str(data["backend"]),
        devices=tuple(data.get("devices", ())),
        bytes=int(data["bytes"]),
        iterations=int(data["iterations"]),
        seconds=tuple(float(s) for s in data.get("seconds", ())),
        gb_per_s=float(data["gb_per_s"]),
        need_gb_per_s=need,
        tokens_per_s=tokens_per_s,
        hidden_bytes_per_token=per_token,
    )


def _model_facts(facts: Facts) -> tuple[dict[str, Any] | None, int | None]:
    config = None
    try:
        loaded = json.loads(answer_text(facts.container, "model_config") or "null")
        config = loaded if isinstance(loaded, dict) else None
    except json.JSONDecodeError:
        config = None
    size = answer_text(facts.container, "model_bytes").split()
    return config, (int(size[0]) * 1024 if size and size[0].isdigit() else None)


def check(
    target: Target, *, bandwidth: bool = False, tokens_per_s: float = DEFAULT_TOKENS_PER_S
) -> DoctorReport:
    """Probe the target (one command per location) and judge; ``bandwidth`` adds the measured probe."""
    spec = target.spec
    loaded = spec.run.loaded
    pretrained = loaded is not None and loaded.model.kind == "pretrained"
    facts = probe(target, loaded.model.path if pretrained else "")
    model_config, model_bytes = _model_facts(facts)
    needs = run_needs(spec, model_config, model_bytes)
    bw = measure_bandwidth(target, needs, tokens_per_s) if bandwidth else None
    return evaluate(spec, facts, needs, bw)


def doctor_task(
    target: Target,
    *,
    as_json: bool = False,
    bandwidth: bool = False,
    tokens_per_s: float = DEFAULT_TOKENS_PER_S,
) -> str:
    """``fab doctor``: the report; prints it and raises ``FleetError`` (exit 1) when a check failed."""
    report = check(target, bandwidth=bandwidth, tokens_per_s=tokens_per_s)
    out = report.to_json() if as_json else report.text()
    if report.ok:
        return out
    print(out.rstrip("\n"), flush=True)
    raise FleetError(f"{report.target}: not fit to train: {report.summary()}")


__all__ = [
    "DEFAULT_TOKENS_PER_S",
    "Bandwidth",
    "DoctorReport",
    "Facts",
    "Finding",
    "RunNeeds",
    "check",
    "dev_entries",
    "doctor_task",
    "evaluate",
    "measure_bandwidth",
    "memory_limit",
    "mounted_paths",
    "parse_ct_config",
    "parse_device_rules",
    "parse_df",
    "parse_gpu_matrix",
    "parse_libs",
    "parse_module_version",
    "parse_smi_xml",
    "probe",
    "run_needs",
]
