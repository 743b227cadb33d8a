"""The env's torch build against the GPUs' architecture: pure rules on recorded captures and real
build lists, torch's own check as the independent implementation, and the refusal through `fab`.

Arch lists are what real builds print: the dev venv's torch (read here), PyPI's torch 2.6 cu126 and a
cu118 build as torch's start-up warning prints them for an sm_120 GPU (pytorch/pytorch#150733 and the
threads in envs/README.md, "GPU architectures").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from fleet import envs
from fleet.doctor import checks as doctor_checks
from fleet.gpu_arch import GpuCap, arch_mismatch, jit_only, parse_arch, parse_caps, unserved
from fleet.inventory import TargetSpec
from fleet.remote import Answer
from fleet.target import open_target

REPO = Path(__file__).resolve().parents[2]
SMI = REPO / "tests" / "fixtures" / "nvidia-smi"
SHIM = REPO / "tests" / "shims" / "nvidia-smi"

CU126 = "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90".split()  # PyPI torch 2.6.0 (CUDA 12.6)
CU118 = "sm_37 sm_50 sm_60 sm_61 sm_70 sm_75 sm_80 sm_86 sm_90 compute_37".split()
CU130 = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120".split()  # PyPI torch 2.13.0 (CUDA 13.0): the dev venv's
REAL_CAPS = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]  # T4 .. RTX PRO 6000 Blackwell


def caps_of(name: str) -> tuple[GpuCap, ...]:
    return parse_caps((SMI / name / "caps.csv").read_text())


@pytest.mark.parametrize(
    ("arch", "cap", "runs"),
    [
        ("sm_86", (8, 9), True),  # a cubin runs on a later minor of its major
        ("sm_86", (8, 0), False),  # not an earlier one
        ("sm_90", (10, 0), False),  # never across majors
        ("sm_100", (12, 0), False),  # B200's cubins are not the RTX PRO 6000's
        ("sm_120", (12, 0), True),
        ("sm_120", (12, 1), True),
        ("sm_90a", (9, 0), True),  # architecture-specific: that one alone
        ("sm_100a", (10, 3), False),
        ("sm_100f", (10, 3), True),  # family-specific: the same major, later minors
        ("compute_90", (12, 0), True),  # PTX JIT-compiles for any later GPU
        ("compute_90", (8, 9), False),
        ("compute_120a", (12, 1), False),
    ],
)
def test_cuda_compatibility_rules(arch: str, cap: tuple[int, int], runs: bool) -> None:
    parsed = parse_arch(arch)
    assert parsed is not None and parsed.runs_on(cap) is runs


def test_parse_arch_rejects_other_words() -> None:
    assert parse_arch("gfx90a") is None and parse_arch("sm_") is None


def test_caps_of_the_recorded_captures() -> None:
    (real,) = parse_caps((SMI / "h200x2" / "caps_h200x1.csv").read_text())  # the device's H200
    assert (real.index, real.name, real.cap) == (0, "NVIDIA H200", (9, 0))
    assert [(g.index, g.name, g.cap) for g in caps_of("idle")] == [
        (0, "NVIDIA H200", (9, 0)),
        (1, "NVIDIA H200", (9, 0)),
    ]
    blackwell = caps_of("blackwell")
    assert [g.index for g in blackwell] == [0, 1]
    assert {(g.name, g.cap) for g in blackwell} == {("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0))}
    with pytest.raises(ValueError, match="not a compute_cap query"):
        parse_caps((SMI / "idle" / "query.csv").read_text())
    na = parse_caps("index, name, compute_cap\n0, NVIDIA H200, [N/A]\n")
    assert na == ()


def test_an_sm120_gpu_and_an_env_without_sm120_is_one_line_naming_both_and_the_fix() -> None:
    why = arch_mismatch("train", "2.6.0+cu126", CU126, caps_of("blackwell"))
    assert "\n" not in why
    assert "torch 2.6.0+cu126 has kernels for sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90, no PTX" in why
    assert "GPU 0, 1 NVIDIA RTX PRO 6000 Blackwell Server Edition (compute capability 12.0, sm_120)" in why
    assert "sm_120" in why.split("lock ")[1] and "envs/train" in why and "fab env-rebuild" in why


def test_an_env_with_sm120_passes_and_h200_passes_either_way() -> None:
    assert arch_mismatch("train", "2.13.0+cu130", CU130, caps_of("blackwell")) == ""
    assert arch_mismatch("train", "2.6.0+cu126", CU126, caps_of("idle")) == ""
    assert arch_mismatch("train", "2.13.0+cu130", CU130, caps_of("idle")) == ""


def test_ptx_serves_a_later_gpu_by_jit_only() -> None:
    blackwell = caps_of("blackwell")
    assert unserved(CU118, blackwell) == () and jit_only(CU118, blackwell) == blackwell
    assert jit_only(CU130, blackwell) == () and jit_only(CU118, caps_of("idle")) == ()
    why, note = envs.gpu_arch_problem(
        "train",
        {"torch": "2.1.0+cu118", "torch_cuda": "11.8", "torch_arch_list": CU118},
        {"exit_code": 0, "output": (SMI / "blackwell" / "caps.csv").read_text()},
    )
    assert why == "" and "only PTX for sm_120" in note


def test_the_dev_venvs_torch_lists_its_architectures_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    probe = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-I", str(envs.PROBE), "verify", "--torch"],
        capture_output=True,
        text=True,
        check=False,
    )
    if torch.version.cuda is None:
        pytest.skip("a CPU-only torch lists no GPU architectures")
    arch = json.loads(probe.stdout)["torch_arch_list"]
    assert arch == torch.cuda.get_arch_list() and all(parse_arch(a) for a in arch), arch


@pytest.mark.parametrize("arch_list", [CU126, CU130, ["sm_80"], ["sm_90", "sm_120"]])
def test_cubins_agree_with_torchs_own_check(arch_list: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's start-up check (``torch.cuda._check_cubins``: same major, any minor) on every real
    capability: it warns exactly where fleet finds no cubin (these lists hold each major's lowest minor)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.cuda, "_check_cubins"):
        pytest.skip("this torch has no _check_cubins")
    for cap in REAL_CAPS:
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _i=0, cap=cap: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "GPU")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda._check_cubins()
        torch_refuses = any("not compatible" in str(w.message) for w in seen)
        fleet_refuses = bool(unserved(arch_list, [GpuCap(0, "GPU", cap)]))
        assert torch_refuses == fleet_refuses, (arch_list, cap)


# --- fab doctor ---------------------------------------------------------------------------------------


def doctor_finding(manifest: dict[str, object], caps: Answer | None) -> doctor_checks.Finding:
    sections = {"env": Answer(0, json.dumps(manifest))} | ({"caps": caps} if caps else {})
    spec = TargetSpec(name="t", host="local", workdir="/w", gpus=2, env="train")
    return doctor_checks._torch_arch(spec, sections)


def test_doctor_names_the_gpu_architecture() -> None:
    blackwell = Answer(0, (SMI / "blackwell" / "caps.csv").read_text())
    old = {"torch": "2.6.0+cu126", "torch_cuda": "12.6", "torch_arch_list": CU126}
    fail = doctor_finding(old, blackwell)
    assert fail.status == "fail" and "sm_120" in fail.message and fail.fix.startswith("lock a torch built")
    new = {"torch": "2.13.0+cu130", "torch_cuda": "13.0", "torch_arch_list": CU130}
    assert doctor_finding(new, blackwell).status == "ok"
    assert doctor_finding(old, Answer(0, (SMI / "idle" / "caps.csv").read_text())).status == "ok"
    unrecorded = doctor_finding({"torch": "2.6.0+cu126", "torch_cuda": "12.6"}, blackwell)
    assert unrecorded.status == "warn" and "fab env-rebuild" in unrecorded.fix
    unread = doctor_finding(new, Answer(2, 'Field "compute_cap" is not a valid field to query.'))
    assert unread.status == "warn" and "not a valid field" in unread.message


# --- the refusal through `fab`, before anything launches ----------------------------------------------

UV = envs.controller_uv()[0] if shutil.which("uv") or (REPO / ".venv/bin/uv").exists() else None


@pytest.mark.skipif(UV is None, reason="uv not installed (./bootstrap installs it into .venv)")
def test_fab_refuses_an_env_without_the_gpus_architecture_before_launching(
    tmp_path: Path, local_tmux
) -> None:  # type: ignore[no-untyped-def]
    """A local GPU target (nvidia-smi: the shim on the Blackwell capture) whose env was built by
    real uv; its manifest's torch fields are what a cu126 torch records (the smoke env has no torch)."""
    from testkit import fab, render_inventory

    wd = tmp_path / "work"
    spec = TargetSpec(name="gpubox", host="local", workdir=str(wd), env="smoke")
    with open_target(spec) as target:
        info = envs.ensure_env(target, REPO)
    manifest_path = Path(info.path) / "fleet-env" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(
        json.dumps(manifest | {"torch": "2.6.0+cu126", "torch_cuda": "12.6", "torch_arch_list": CU126})
    )
    target_toml = {
        "host": "local",
        "workdir": str(wd),
        "gpus": 2,
        "env": "smoke",
        "commands": {"nvidia_smi": str(SHIM)},
        "gpu_gate": {"timeout_s": 10},
        "run": {"module": "training.selftest", "config": "selftest", "overrides": [], "env": {}},
    }
    config = tmp_path / "fleet.toml"
    config.write_text(render_inventory({"gpubox": target_toml}, "gpubox"))

    def run(scenario: str, *args: str) -> subprocess.CompletedProcess[str]:
        return fab(*args, config=config, timeout=120, env={"FLEET_NVSMI_FIXTURE_DIR": str(SMI / scenario)})

    refused = run("blackwell", "train")
    assert refused.returncode == 6, refused.stdout + refused.stderr
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert line.startswith("fleet: gpubox: refused: env smoke's torch 2.6.0+cu126 has kernels for sm_50"), (
        line
    )
    assert "sm_120" in line and "Traceback" not in refused.stderr
    assert local_tmux.run("has-session", "-t", "fleet-run", check=False).returncode != 0
    assert not (wd / "runs").exists()
    check = run("blackwell", "env-check", "--json")
    assert check.returncode == 1 and "sm_120" in json.loads(check.stdout)["gpu_arch"]
    h200 = run("idle", "env-check", "--json")
    assert h200.returncode == 0 and json.loads(h200.stdout)["gpu_arch"] == "", h200.stdout + h200.stderr
    new = {"torch": "2.13.0+cu130", "torch_cuda": "13.0", "torch_arch_list": CU130}
    manifest_path.write_text(json.dumps(manifest | new))
    fits = run("blackwell", "env-check", "--json")
    assert fits.returncode == 0 and json.loads(fits.stdout)["gpu_arch"] == "", fits.stdout + fits.stderr
