"""`fab doctor`: the pure parsers on recorded real output, the verdicts, and the run-size estimates
against the sizes measured on 2x H200 (field notes)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fleet import doctor
from fleet.doctor import Bandwidth, Facts, RunNeeds
from fleet.gpus import Answer
from fleet.inventory import Commands, ContainerSpec, RunSpec, TargetSpec, Topology, load_inventory
from training.config import load_config

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
PCT_SHIM = REPO / "tests" / "hosts" / "pct"
BANDWIDTH = REPO / "fleet" / "remote" / "doctor_bandwidth.py"


def read(*parts: str) -> str:
    return FIXTURES.joinpath(*parts).read_text()


def run_of(config: str, *overrides: str) -> RunSpec:
    """The run as the inventory loads it: the config read with the trainer's loader."""
    return RunSpec(config=config, overrides=overrides, loaded=load_config(config, overrides))


def spec_for(**changes: object) -> TargetSpec:
    base: dict[str, object] = {
        "name": "ct200",
        "host": "root@pve.example:22",
        "workdir": "/workspace/fleet",
        "container": ContainerSpec(type="pct", id=200),
        "gpus": 2,
        "topology": Topology(1, 1),
        "env": "",
        "run": run_of("tiny-cpu"),
        "commands": Commands(),
    }
    base.update(changes)
    return TargetSpec(**base)  # type: ignore[arg-type]


def recorded() -> Facts:
    """The well-configured test container, as its doctor scripts answered (tests/fixtures/doctor)."""
    return Facts(
        doctor.parse_sections(read("doctor", "ct200_container.txt")),
        doctor.parse_sections(read("doctor", "ct200_host.txt")),
    )


def with_sections(
    facts: Facts, *, container: dict[str, Answer] | None = None, host: dict[str, Answer] | None = None
) -> Facts:
    assert facts.host is not None
    return Facts({**facts.container, **(container or {})}, {**facts.host, **(host or {})})


def tiny_needs(spec: TargetSpec) -> RunNeeds:
    return doctor.run_needs(spec)


def verdict(facts: Facts, spec: TargetSpec | None = None, **kw: object) -> doctor.DoctorReport:
    spec = spec or spec_for()
    return doctor.evaluate(spec, facts, tiny_needs(spec), **kw)  # type: ignore[arg-type]


def by_check(report: doctor.DoctorReport) -> dict[str, doctor.Finding]:
    return {f.check: f for f in report.findings}


def fails(report: doctor.DoctorReport) -> list[str]:
    return [f.line() for f in report.findings if f.status == "fail"]


# --- parsers ---------------------------------------------------------------------------------------


def render_pct_config(tmp_path: Path, conf: str, vmid: int = 400) -> subprocess.CompletedProcess[str]:
    (tmp_path / f"{vmid}.conf").write_text(conf)
    return subprocess.run(
        [sys.executable, str(PCT_SHIM), "config", str(vmid)],
        env={"FLEET_PCT_CONF_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )


def test_real_gpu_container_config_parses_from_the_file_and_from_pct_config(tmp_path: Path) -> None:
    raw = read("pct", "dryqin-400.conf")
    shown = render_pct_config(tmp_path, raw)
    assert shown.returncode == 0, shown.stderr
    # pct prints the keys sorted, the `#` lines as one URI-encoded description, then lxc.* in order
    assert shown.stdout.splitlines()[3] == (
        "description: VI %3A /etc/pve/lxc/<CONTAINER_ID>.conf%0A Deep Learning Container "
        "(CUDA, cuDNN, OpenCL support)%0A GPU Passthrough config%0A"
    )
    assert shown.stdout.splitlines()[-1] == (
        "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file"
    )
    from_file, from_pct = doctor.parse_ct_config(raw), doctor.parse_ct_config(shown.stdout)
    assert from_file.lxc == from_pct.lxc and len(from_pct.lxc) == 7
    assert from_pct.keys["memory"] == "16384" and from_pct.keys["hostname"] == "MachineLearning"
    rules = doctor.parse_device_rules(from_pct)
    assert [(r.major, r.minor, r.cgroup_v1) for r in rules] == [(195, None, True), (243, None, True)]
    assert set(doctor.mounted_paths(from_pct)) == {
        "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset", "/dev/nvidia-uvm-tools",
    }  # fmt: skip


def test_pct_config_of_a_missing_container_is_pcts_error(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, str(PCT_SHIM), "config", "999"],
        env={"FLEET_PCT_CONF_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (missing.returncode, missing.stdout) == (255, "")
    assert missing.stderr == "Configuration file 'nodes/fleet-test/lxc/999.conf' does not exist\n"


def test_lxc_style_config_and_dev_entries() -> None:
    config = doctor.parse_ct_config(
        "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: path=/dev/nvidiactl\n"
        "lxc.cgroup2.devices.allow = a\nlxc.mount.entry = /dev/nvidia-uvm dev/nvidia-uvm none bind 0 0\n"
        "[snap1]\nlxc.mount.entry: /dev/nvidia9 dev/nvidia9 none bind\n"
    )
    assert doctor.dev_entries(config) == {"/dev/nvidia0", "/dev/nvidiactl"}
    assert "/dev/nvidia-uvm" in doctor.mounted_paths(config) and "/dev/nvidia9" not in doctor.mounted_paths(
        config
    )
    (rule,) = doctor.parse_device_rules(config)
    assert rule.kind == "a" and rule.allows(511, 0)
    read_only = doctor.parse_device_rules(doctor.parse_ct_config("lxc.cgroup2.devices.allow: c 195:0 r\n"))
    assert not read_only[0].allows(195, 0)


def test_module_version_of_the_proprietary_and_the_open_kernel_module() -> None:
    assert doctor.parse_module_version(read("driver", "proc_version_proprietary.txt")) == "384.98"
    assert doctor.parse_module_version(read("driver", "proc_version_open.txt")) == "565.57.01"
    assert doctor.parse_module_version("cat: /proc/driver/nvidia/version: No such file or directory") is None
    assert doctor.parse_module_version(read("driver", "proc_version_h200x2.txt")) == "580.159.04"  # no date


def test_topology_and_p2p_matrices() -> None:
    phb = doctor.parse_gpu_matrix(read("nvidia-smi", "topo", "rtx5090x2_phb.txt"))
    assert phb == {(0, 0): "X", (0, 1): "PHB", (1, 0): "PHB", (1, 1): "X"}
    nv6 = doctor.parse_gpu_matrix(read("nvidia-smi", "topo", "h100x4_nv6.txt"))  # spaces, NICs
    assert len(nv6) == 16 and nv6[(0, 3)] == nv6[(3, 2)] == "NV6" and nv6[(2, 2)] == "X"
    assert doctor.parse_gpu_matrix(read("nvidia-smi", "topo", "rtx5090x2_p2p_gns.txt"))[(0, 1)] == "GNS"
    assert doctor.parse_gpu_matrix(read("nvidia-smi", "topo", "rtx5090x2_p2p_ok.txt"))[(1, 0)] == "OK"
    h200 = doctor.parse_gpu_matrix(read("nvidia-smi", "h200x2", "topo.txt"))  # underlined header
    assert h200 == {(0, 0): "X", (0, 1): "NV18", (1, 0): "NV18", (1, 1): "X"}
    assert doctor.parse_gpu_matrix(read("nvidia-smi", "h200x2", "p2p_r.txt"))[(0, 1)] == "OK"
    styled = "\x1b[4mGPU0\tGPU1\tCPU Affinity\x1b[0m\nGPU0\t X \tNV18\t0-47\nGPU1\tNV18\t X \t0-47\n"
    assert doctor.parse_gpu_matrix(styled)[(1, 0)] == "NV18"


def test_smi_xml_of_the_h200s_and_of_a_gpu_needing_service() -> None:
    smi = doctor.parse_smi_xml(read("nvidia-smi", "h200x2", "q_idle.xml"))
    assert (smi.driver_version, smi.cuda_version) == ("580.159.04", "13.0")
    assert [
        (g.minor, g.bus_id, g.persistence, g.ecc_enabled, g.ecc_uncorrected, g.slowdowns) for g in smi.gpus
    ] == [
        (0, "00000000:00:06.0", True, True, 0, ()),
        (1, "00000000:00:07.0", True, True, 0, ()),
    ]
    broken = doctor.parse_smi_xml(read("nvidia-smi", "remap_failure", "q.xml"))
    assert broken.gpus[1].health is not None and broken.gpus[1].health.remap_failure


def test_libs_take_the_version_so1_resolves_to() -> None:
    libs = doctor.parse_libs(doctor.parse_sections(read("doctor", "ct200_container.txt"))["libs"].output)
    assert libs.loaded == {"libnvidia-ml": "580.159.04", "libcuda": "580.159.04"}
    stale = doctor.parse_libs(
        "link /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.575.57.08\n"
        "file /usr/lib/libcuda.so.575.57.08 /usr/lib/libcuda.so.575.57.08\n"
        "file /usr/lib/libcuda.so.580.159.04 /usr/lib/libcuda.so.580.159.04\n"
    )
    assert stale.loaded == {"libcuda": "575.57.08"} and stale.versions["libcuda"] == (
        "575.57.08",
        "580.159.04",
    )


def test_sections_df_and_memory() -> None:
    sections = recorded().container
    assert doctor.parse_df(sections["shm"].output) == (4 * 1024**3, 4 * 1024**3, "/dev/shm")
    assert doctor.parse_df("df: /dev/shm: No such file or directory") is None
    limit = doctor.memory_limit(None, sections["memory"].output)
    assert limit == (24684100 * 1024, "/proc/meminfo MemTotal")
    host_config = doctor.parse_ct_config(recorded().host["ct_config"].output)  # type: ignore[index]
    assert doctor.memory_limit(host_config, sections["memory"].output) == (
        16384 * 1024**2,
        "pct config memory",
    )


# --- run sizes -------------------------------------------------------------------------------------


def test_run_sizes_match_what_was_measured_on_h200() -> None:
    # field notes: 671 MB of hidden states per qwen3-8b batch (5 x 4 x 4096 x 4096 bf16), 839 MB for
    # the 27B shape; a 1.05B drafter for the 8B shape and a 2.0B drafter for the 27B shape
    for config, batch, drafter in (
        ("qwen3-8b-h200", 671_088_640, 1.05e9),
        ("qwen3-27b-random", 838_860_800, 2.0e9),
    ):
        spec = spec_for(run=run_of(config), gpus=2)
        needs = doctor.run_needs(spec)
        assert needs.batch_hidden_bytes == batch
        assert abs(needs.drafter_params - drafter) / drafter < 0.03, needs.drafter_params


def test_the_shipped_default_is_sized_as_smollm2_135m() -> None:
    spec = load_inventory(REPO / "fleet.toml").targets["local"]
    needs = doctor.run_needs(spec)
    assert (spec.run.config, needs.kind) == ("smol-cpu", "smol")
    assert needs.shape is not None
    assert (needs.shape.hidden_size, needs.shape.num_hidden_layers, needs.shape.vocab_size) == (
        576,
        30,
        49152,
    )
    # float32 on CPU; 5 target layers x 576 per token
    assert needs.dtype_bytes == 4 and needs.hidden_bytes_per_token == 5 * 576 * 4
    (run,) = [f for f in doctor.evaluate(spec, recorded(), needs).findings if f.check == "run size"]
    assert "576 wide, 30 layers, vocab 49,152" in run.message


def test_pretrained_target_shape_comes_from_its_config_json() -> None:
    spec = spec_for(run=run_of("qwen3.6-27b-5p3", "--data.token_budget=16384"), gpus=8)
    text_config = {"hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408}
    text_config.update(num_attention_heads=24, num_key_value_heads=4, head_dim=256)
    qwen36 = {"text_config": text_config}
    needs = doctor.run_needs(spec, qwen36, 55 * 1024**3)
    assert needs.kind == "pretrained" and needs.model_path == "/workspace/models/Qwen3.6-27B"
    assert needs.hidden_bytes_per_token == 5 * 5120 * 2 and needs.token_budget == 16384
    assert needs.target_bytes == 55 * 1024**3 and needs.keep_checkpoints == 3
    unknown = doctor.run_needs(spec_for(run=RunSpec(config="/on/the/target.toml")))
    assert not unknown.known


# --- verdicts --------------------------------------------------------------------------------------


def test_the_well_configured_test_container_is_fit() -> None:
    report = verdict(recorded())
    assert report.ok, fails(report)
    checks = by_check(report)
    assert checks["GPU mount entries"].status == checks["cgroup device rules"].status == "ok"
    assert checks["libcuda.so"].message == "libcuda.so.580.159.04 matches the kernel module 580.159.04"
    assert checks["P2P target <-> drafter"].status == "warn"  # the recorded PHB box has no P2P
    assert "GNS over PHB" in checks["P2P target <-> drafter"].message
    assert report.topology.splitlines()[1].startswith("GPU0\t X \tPHB")


def test_cgroup_v1_lines_on_a_cgroup_v2_host_are_named() -> None:
    facts = recorded()
    conf = facts.host["ct_config"].output.replace("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow")  # type: ignore[index]
    report = verdict(
        with_sections(facts, host={"ct_config": Answer(0, conf), "cgroupfs": Answer(0, "cgroup2fs")})
    )
    (line,) = fails(report)
    assert line.startswith("cgroup v1 device rules: pct config 200 allows /dev/nvidia0, /dev/nvidia1,")
    assert "rename those lines to lxc.cgroup2.devices.allow in /etc/pve/lxc/200.conf" in line


def test_a_missing_cgroup_rule_names_the_device_and_the_line_to_add() -> None:
    facts = recorded()
    conf = facts.host["ct_config"].output.replace("lxc.cgroup2.devices.allow: c 511:* rwm\n", "")  # type: ignore[index]
    (line,) = fails(verdict(with_sections(facts, host={"ct_config": Answer(0, conf)})))
    assert (
        "no lxc.cgroup2.devices.allow rule for /dev/nvidia-uvm (c 511:0), /dev/nvidia-uvm-tools (c 511:1)"
        in line
    )
    assert 'add "lxc.cgroup2.devices.allow: c 511:* rwm" to /etc/pve/lxc/200.conf' in line


def test_the_real_pve6_config_on_a_cgroup_v2_host(tmp_path: Path) -> None:
    facts = recorded()
    shown = render_pct_config(tmp_path, read("pct", "dryqin-400.conf"), vmid=200).stdout
    one_gpu = {"ct_config": Answer(0, shown), "cgroupfs": Answer(0, "cgroup2fs"),
               "proc_devices": Answer(0, "195 nvidia\n243 nvidia-uvm\n")}  # fmt: skip
    report = verdict(with_sections(facts, host=one_gpu))
    lines = fails(report)
    assert any(
        "passes 1 GPU(s) (/dev/nvidia0), gpus = 2: no lxc.mount.entry for /dev/nvidia1" in x for x in lines
    )
    assert any(x.startswith("cgroup v1 device rules:") for x in lines)
    assert by_check(report)["/dev/nvidia-caps mount entry"].status == "warn"


def test_library_version_mismatch_names_both_versions() -> None:
    facts = recorded()
    libs = facts.container["libs"].output.replace("libcuda.so.580.159.04", "libcuda.so.575.57.08")
    (line,) = fails(verdict(with_sections(facts, container={"libs": Answer(0, libs)})))
    assert line.startswith(
        "libcuda.so: container 200's libcuda.so.575.57.08 does not match the kernel module 580.159.04"
    )
    # the kernel's own version file wins over nvidia-smi's answer
    module = Answer(0, read("driver", "proc_version_open.txt"))
    lines = fails(verdict(with_sections(facts, container={"module": module})))
    assert len(lines) == 2 and "kernel module 565.57.01 (/proc/driver/nvidia/version)" in lines[0]


def test_nccl_needs_each_name_the_fault() -> None:
    facts = recorded()
    tiny_shm = "Filesystem 1024-blocks Used Available Capacity Mounted on\nshm 65536 0 65536 0% /dev/shm\n"
    full = (
        "Filesystem 1024-blocks Used Available Capacity Mounted on\ntmpfs 8192 8192 0 100% /workspace/fleet\n"
    )
    cases = {
        "/dev/shm": (
            {"shm": Answer(0, tiny_shm)},
            "/dev/shm in container 200 is 64 MiB, NCCL and DataLoader",
        ),
        "hostname": (
            {"resolve": Answer(2, "")},
            "the hostname 'fleet-doctor-ct200' of container 200 does not resolve",
        ),
        "disk": ({"disk": Answer(0, full)}, "0 KiB free on /workspace/fleet (workdir /workspace/fleet)"),
        "ulimit -n": ({"ulimit": Answer(0, "memlock unlimited\nnofile 256")}, "nofile is 256"),
    }
    for check, (sections, expected) in cases.items():
        (line,) = fails(verdict(with_sections(facts, container=sections)))
        assert line.startswith(f"{check}: ") and expected in line and "; fix: " in line, line


def test_memory_limit_against_a_pretrained_target() -> None:
    spec = spec_for(run=run_of("qwen3.6-27b-5p3"), gpus=8, topology=Topology(5, 3))
    needs = doctor.run_needs(spec, {"hidden_size": 5120}, 55 * 1024**3)
    report = doctor.evaluate(spec, recorded(), needs)
    memory = by_check(report)["memory"]
    assert (
        memory.status == "fail" and "memory limit 16.0 GiB (pct config memory) < ~79.0 GiB" in memory.message
    )
    assert memory.fix == "raise it: `pct set 200 -memory <MiB>`"


def test_gpu_health_problems_are_one_line_per_gpu() -> None:
    facts = recorded()
    xml = read("nvidia-smi", "h200x2", "q_idle.xml")
    xml = xml.replace(
        "<persistence_mode>Enabled</persistence_mode>", "<persistence_mode>Disabled</persistence_mode>", 1
    )
    xml = xml.replace(
        "<clocks_event_reason_hw_thermal_slowdown>Not Active",
        "<clocks_event_reason_hw_thermal_slowdown>Active",
        1,
    )
    xml = xml.replace(
        "<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>2</dram_uncorrectable>", 1
    )
    report = verdict(with_sections(facts, host={"smi_xml": Answer(0, xml)}))
    gpu0 = by_check(report)["GPU 0 (NVIDIA H200)"]
    assert gpu0.status == "fail" and by_check(report)["GPU 1 (NVIDIA H200)"].status == "ok"
    assert gpu0.message == (
        "persistence mode off (each process pays the driver start-up, the GPU may reset its clocks); "
        "clocks held back: hardware thermal slowdown; 2 uncorrected volatile ECC error(s)"
    )


def test_torch_cuda_build_against_the_driver() -> None:
    facts = recorded()
    spec = spec_for(env="train")
    manifest = {"torch": "2.13.0+cu132", "torch_cuda": "13.2"}
    report = verdict(with_sections(facts, container={"env": Answer(0, json.dumps(manifest))}), spec)
    torch = by_check(report)["torch CUDA build"]
    assert (
        torch.status == "fail"
        and "torch is built for CUDA 13.2 but the driver supports CUDA 13.0" in torch.message
    )
    fine = {"torch": "2.11.0+cu130", "torch_cuda": "13.0"}
    ok = by_check(verdict(with_sections(facts, container={"env": Answer(0, json.dumps(fine))}), spec))
    assert ok["torch CUDA build"].status == "ok"
    unbuilt = by_check(verdict(with_sections(facts, container={"env": Answer(1, "cat: no such file")}), spec))
    assert unbuilt["torch CUDA build"].status == "skip"


def test_a_cpu_target_runs_the_checks_that_apply() -> None:
    facts = Facts(recorded().container)
    spec = spec_for(container=None, host="local", gpus=0, topology=None)
    report = verdict(facts, spec)
    assert report.ok and not report.topology
    checks = by_check(report)
    assert checks["GPU checks"].status == "skip" and "gpus = 0" in checks["GPU checks"].message
    assert checks["ulimit -l"].status == "skip" and checks["/dev/shm"].status == "ok"
    assert not any(f.area in ("passthrough", "driver", "topology", "health") for f in report.findings)


def test_bandwidth_against_what_the_run_needs() -> None:
    spec = spec_for()
    common = {"devices": ("GPU0 (NVIDIA H200)", "GPU1 (NVIDIA H200)"), "bytes": 671_088_640}
    common.update(iterations=5, seconds=(0.0019,) * 5, tokens_per_s=20_000.0, hidden_bytes_per_token=40_960)
    fast = Bandwidth(backend="nccl", gb_per_s=353.2, need_gb_per_s=0.8192, **common)  # type: ignore[arg-type]
    line = by_check(verdict(recorded(), spec, bandwidth=fast))["send/recv"]
    assert line.status == "ok" and line.message.startswith("353.2 GB/s (nccl, GPU0 (NVIDIA H200) -> GPU1")
    assert "the run needs 0.82 GB/s (40960 B of hidden states per token x 20,000 tokens/s)" in line.message
    slow = replace(fast, gb_per_s=0.5)
    assert by_check(verdict(recorded(), spec, bandwidth=slow))["send/recv"].status == "fail"


def test_report_views() -> None:
    facts = recorded()
    report = verdict(with_sections(facts, container={"resolve": Answer(2, "")}))
    text = report.text()
    assert "ct200: NOT FIT: 1 problem(s): hostname (the FAIL lines above say what to do)" in text
    fail_lines = [line for line in text.splitlines() if line.startswith("FAIL ")]
    assert fail_lines == ["FAIL " + fails(report)[0]]
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["gpus"] == 2 and data["needs"]["config"] == "tiny-cpu"
    assert any(x.startswith("hostname: the hostname") for x in data["lines"])


# --- the bandwidth probe itself (real processes, real torch.distributed) --------------------------


def run_probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-c", BANDWIDTH.read_text(), *args],  # as fab doctor runs it
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_bandwidth_probe_sends_between_two_cpu_processes_over_gloo() -> None:
    result = run_probe("--bytes", str(3 * 1024 * 1024), "--cpu", "--iterations", "3")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["backend"] == "gloo" and data["bytes"] == 3 * 1024 * 1024 and len(data["seconds"]) == 3
    assert data["gb_per_s"] > 0 and data["devices"] == ["cpu rank 0", "cpu rank 1"]


def test_bandwidth_probe_without_gpus_is_one_error_line() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the NCCL path is measured on the device (benchmarks/RESULTS.md)")
    result = run_probe("--bytes", "1024", "--gpus", "0,1", "--timeout", "60")
    assert result.returncode == 1
    (line,) = result.stdout.splitlines()
    error = json.loads(line)["error"]
    assert error.startswith("rank ") and f"RuntimeError: torch {torch.__version__} sees no GPU" in error
