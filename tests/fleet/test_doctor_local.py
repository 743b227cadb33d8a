"""`fab doctor` on this machine as a `local` target (gpus = 0): the real `fab`, the real scripts
(sh, df, getent, ...) and, with --bandwidth, two real processes sending over torch.distributed (gloo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import testkit

REPO = Path(__file__).resolve().parents[2]
FAB = Path(sys.executable).parent / "fab"


def fab(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return testkit.fab(*args, config=config, timeout=300)


def local_config(
    tmp_path: Path, env: str = "", python: str = sys.executable, run_config: str = "tiny-cpu"
) -> Path:
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'default_target = "here"\n[targets.here]\nhost = "local"\nworkdir = "state"\n'
        f'gpus = 0\nenv = "{env}"\n'
        f'[targets.here.run]\nconfig = "{run_config}"\n[targets.here.commands]\npython = "{python}"\n'
    )
    return config


def hostname_fails(stdout: str) -> bool:
    """Whether doctor's hostname check fails on this machine: where its hostname does not resolve
    (a fresh debootstrap chroot has no /etc/hosts line for it: torchrun could not run there), and
    then doctor must say so."""
    name = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    if subprocess.run(["getent", "hosts", name], capture_output=True, check=False).returncode == 0:
        return False
    said = rf"^(FAIL )?hostname: the hostname {re.escape(repr(name))} of .* does not resolve"
    assert re.search(said, stdout, re.M), stdout
    return True


def test_doctor_on_a_cpu_target_sizes_the_shipped_smol_run(tmp_path: Path) -> None:
    result = fab(local_config(tmp_path, run_config="smol-cpu"), "doctor")
    assert "gpus = 0: passthrough, driver, topology and health do not apply" in result.stdout
    if hostname_fails(result.stdout):
        assert result.returncode == 1 and "1 problem(s): hostname" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "here: OK: fit to train" in result.stdout
    # SmolLM2-135M as its model card has it, not the tiny model's defaults
    assert "smol-cpu: target (smol) 576 wide, 30 layers, vocab 49,152" in " ".join(result.stdout.split())


def test_doctor_bandwidth_on_cpu_measures_two_gloo_processes(tmp_path: Path) -> None:
    result = fab(local_config(tmp_path), "doctor", "--bandwidth", "--json")
    data = json.loads(result.stdout)
    unresolved = hostname_fails("\n".join(data["lines"]))
    assert result.returncode == (1 if unresolved else 0), result.stdout + result.stderr
    failed = [f["check"] for f in data["findings"] if f["status"] == "fail"]
    assert failed == (["hostname"] if unresolved else []), failed
    bandwidth = data["bandwidth"]
    # tiny-cpu: 1024 tokens per batch x 3 target layers x hidden 128 x float32 on CPU
    assert bandwidth["backend"] == "gloo" and bandwidth["bytes"] == 1024 * 3 * 128 * 4
    assert bandwidth["gb_per_s"] > 0 and bandwidth["need_gb_per_s"] is None
    (line,) = [x for x in data["lines"] if x.startswith("send/recv: ")]
    assert "CPU processes over gloo, not a GPU link" in line


def test_doctor_bandwidth_without_the_env_is_a_failed_check(tmp_path: Path) -> None:
    result = fab(local_config(tmp_path, env="local-cpu", python="python3"), "doctor", "--bandwidth")
    assert result.returncode == 1, result.stdout + result.stderr
    (error,) = result.stderr.splitlines()
    failed = "1 problem(s): send/recv"
    if hostname_fails(result.stdout):
        failed = "2 problem(s): hostname, send/recv"
    assert error == f"fleet: here: not fit to train: {failed} (the FAIL lines above say what to do)"
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("FAIL send/recv")]
    python = tmp_path / "state" / "envs" / "local-cpu" / "current" / "bin" / "python"
    assert line.startswith(f"FAIL send/recv: {python} does not run (")
    assert line.endswith("; fix: `fab deploy` builds the env")
