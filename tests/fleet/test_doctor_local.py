"""`fab doctor` on this machine as a `local` target (gpus = 0): the real `fab`, the real scripts
(sh, df, getent, ...) and, with --bandwidth, two real processes sending over torch.distributed (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAB = Path(sys.executable).parent / "fab"


def fab(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_CONFIG"] = str(config)
    return subprocess.run([str(FAB), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


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


def test_doctor_on_a_cpu_target_sizes_the_shipped_smol_run(tmp_path: Path) -> None:
    result = fab(local_config(tmp_path, run_config="smol-cpu"), "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpus = 0: passthrough, driver, topology and health do not apply" in result.stdout
    assert "here: OK: fit to train" in result.stdout
    # SmolLM2-135M as its model card has it, not the tiny model's defaults
    assert "smol-cpu: target (smol) 576 wide, 30 layers, vocab 49,152" in " ".join(result.stdout.split())


def test_doctor_bandwidth_on_cpu_measures_two_gloo_processes(tmp_path: Path) -> None:
    result = fab(local_config(tmp_path), "doctor", "--bandwidth", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
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
    assert (
        error
        == "fleet: here: not fit to train: 1 problem(s): send/recv (the FAIL lines above say what to do)"
    )
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("FAIL ")]
    python = tmp_path / "state" / "envs" / "local-cpu" / "current" / "bin" / "python"
    assert line.startswith(f"FAIL send/recv: {python} does not run (")
    assert line.endswith("; fix: `fab deploy` builds the env")
