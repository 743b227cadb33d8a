"""The clean-GPU gate: parsers on real nvidia-smi captures and hand-made edge cases, the checks,
and the gate run for real (sh + the nvidia-smi shim + ps) against the local target."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import framed

from fleet import gpus
from fleet.errors import FleetError, GpuGateError
from fleet.gpus import Answer, Probe
from fleet.inventory import Commands, ContainerSpec, GateSpec, TargetSpec, Topology
from fleet.target import open_target

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
REAL = FIXTURES / "h200x2"
SHIM = REPO / "tests" / "shims" / "nvidia-smi"
UUID0 = "GPU-f0e3b5c2-09f8-8f10-167e-529bf94b685d"
UUID1 = "GPU-bc50d39c-603a-a16b-af17-cafb052cf44b"


def read(path: Path) -> str:
    return path.read_text()


def spec_for(workdir: Path | str = "/tmp/fleet-gpus-test", **changes: object) -> TargetSpec:
    base: dict[str, object] = {
        "name": "gputest",
        "host": "local",
        "workdir": str(workdir),
        "gpus": 2,
        "commands": Commands(nvidia_smi=str(SHIM)),
        "gpu_gate": GateSpec(max_memory_mib=64, expected_name="", timeout_s=10),
    }
    base.update(changes)
    return TargetSpec(**base)  # type: ignore[arg-type]


def probe(scenario: str, where: str = "local", *, apps: bool = True, xml: bool = True) -> Probe:
    """A Probe as if the scenario's files had been printed by nvidia-smi (exit 0)."""
    d = FIXTURES / scenario
    if (d / "output").exists():
        answer = Answer(int(read(d / "exit_code")), read(d / "output"))
        return Probe(where, answer, answer if apps else None, answer if xml else None)
    return Probe(
        where,
        Answer(0, read(d / "query.csv")),
        Answer(0, read(d / "apps.csv")) if apps else None,
        (Answer(0, read(d / "q.xml")) if (d / "q.xml").exists() else Answer(3, "not supported"))
        if xml
        else None,
    )


# --- parsers on the real captures ------------------------------------------------------------------


def test_query_gpu_busy_capture() -> None:
    query = gpus.parse_query_gpu(read(REAL / "query_busy.csv"))
    assert query.lost == ()
    g0, g1 = query.gpus
    assert (g0.index, g0.uuid, g0.name, g0.bus_id) == (0, UUID0, "NVIDIA H200", "00000000:00:06.0")
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.memory_free_mib) == (143771, 8719, 134438)
    assert (g0.utilization_pct, g0.temperature_c, g0.power_w) == (0, 38, 119.10)
    assert (g0.driver_version, g0.pstate, g0.ecc_uncorrected_volatile, g0.compute_mode) == (
        "580.159.04", "P0", 0, "Default",
    )  # fmt: skip
    assert (g1.index, g1.uuid, g1.memory_used_mib, g1.power_w) == (1, UUID1, 4, 79.36)


def test_query_gpu_idle_capture() -> None:
    query = gpus.parse_query_gpu(read(REAL / "query_idle.csv"))
    assert [g.memory_used_mib for g in query.gpus] == [0, 0]
    assert [g.uuid for g in query.gpus] == [UUID0, UUID1]


def test_compute_apps_captures() -> None:
    assert gpus.parse_compute_apps(read(REAL / "apps_idle.csv")) == ()
    (app,) = gpus.parse_compute_apps(read(REAL / "apps_busy.csv"))
    assert app == gpus.ComputeApp(566, UUID0, "python3", 8710)


def test_health_xml_capture() -> None:
    health = gpus.parse_health_xml(read(REAL / "q_idle.xml"))
    assert [h.uuid for h in health] == [UUID0, UUID1]
    for h in health:
        assert (h.remap_pending, h.remap_failure, h.remapped_uncorrectable) == (False, False, 0)
        assert h.retirement_pending is None  # H200 reports pages as N/A (it remaps rows instead)


# --- parsers on hand-made edge cases ---------------------------------------------------------------


def test_not_available_fields_are_none() -> None:
    g0, g1 = gpus.parse_query_gpu(read(FIXTURES / "na_fields" / "query.csv")).gpus
    assert g0.name == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert (g0.utilization_pct, g0.power_w, g0.ecc_uncorrected_volatile, g0.memory_used_mib) == (
        None,
        None,
        None,
        3,
    )
    assert (g1.pstate, g1.memory_used_mib, g1.memory_free_mib, g1.temperature_c, g1.compute_mode) == (
        None, None, None, None, None,
    )  # fmt: skip
    (app,) = gpus.parse_compute_apps(read(FIXTURES / "na_fields" / "apps.csv"))
    assert (app.pid, app.process_name, app.used_memory_mib) == (4242, None, None)


def test_lost_gpu_line_is_kept() -> None:
    query = gpus.parse_query_gpu(read(FIXTURES / "gpu_lost" / "query.csv"))
    assert len(query.gpus) == 1
    assert query.lost and "GPU is lost" in query.lost[0]


def test_remap_failure_xml() -> None:
    h0, h1 = gpus.parse_health_xml(read(FIXTURES / "remap_failure" / "q.xml"))
    assert (h0.remap_failure, h0.remap_pending, h0.retirement_pending) == (False, False, None)
    assert (h1.remap_failure, h1.remap_pending, h1.retirement_pending, h1.remapped_uncorrectable) == (
        True, True, True, 2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "printed nothing"),
        ("hello world\n", "no CSV header"),
        ("index, uuid, name\n0, GPU-x, A\n", "lacks"),
        (read(REAL / "query_idle.csv") + "garbage line\n", "unexpected line"),
        (read(REAL / "query_idle.csv").replace("143771 MiB", "lots MiB", 1), "number"),
    ],
)
def test_query_gpu_rejects_garbage(text: str, match: str) -> None:
    with pytest.raises(GpuGateError, match=match):
        gpus.parse_query_gpu(text)


def test_bad_xml_and_apps_are_gate_errors() -> None:
    with pytest.raises(GpuGateError, match="invalid XML"):
        gpus.parse_health_xml("<nvidia_smi_log><gpu>")
    with pytest.raises(GpuGateError, match="no CSV header"):
        gpus.parse_compute_apps("Failed to initialize NVML: Unknown Error")
    assert gpus.parse_compute_apps("No devices were found") == ()


@pytest.mark.parametrize(
    ("scenario_or_answer", "words"),
    [
        ("nvml_mismatch", "version mismatch"),
        ("no_driver", "cannot talk to the NVIDIA driver"),
        (Answer(124, ""), "did not answer within 5s"),
        (Answer(137, ""), "did not answer within 5s"),
        (Answer(127, "sh: 1: nvidia-smi: not found"), "`nvidia-smi` not found"),
        (Answer(15, "Unable to determine the device handle: GPU is lost"), "exited 15: Unable"),
    ],
)
def test_smi_failure_words(scenario_or_answer: str | Answer, words: str) -> None:
    answer = scenario_or_answer if isinstance(scenario_or_answer, Answer) else probe(scenario_or_answer).query
    assert words in (gpus.smi_failure(answer, "nvidia-smi", 5) or "")


def test_smi_failure_none_when_it_answered() -> None:
    assert gpus.smi_failure(Answer(0, read(REAL / "query_idle.csv")), "nvidia-smi") is None
    assert gpus.smi_failure(Answer(6, "No devices were found"), "nvidia-smi") is None


def test_parse_ps_real_output() -> None:
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,pgid=,user=,args=", "-p", f"{os.getpid()},999999999"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    found = gpus.parse_ps(out)
    assert list(found) == [os.getpid()]
    assert found[os.getpid()].pgid == os.getpgid(0)
    assert "pytest" in found[os.getpid()].args or "python" in found[os.getpid()].args


def test_parse_probe_sections() -> None:
    text = framed(("query", 0, "index, uuid"), ("apps", 6, "No devices were found"), ("runids", 0, "12\n34"))
    got = gpus.parse_probe(text, "here")
    assert got.query == Answer(0, "index, uuid")
    assert got.apps == Answer(6, "No devices were found")
    assert (got.xml, got.ps, got.run_ids) == (None, None, "12\n34")
    with pytest.raises(GpuGateError, match="no nvidia-smi answer"):
        gpus.parse_probe("sh: 1: syntax error\n", "here")


# --- checks (pure) ----------------------------------------------------------------------------------


def test_idle_is_clean() -> None:
    report = gpus.evaluate(spec_for(), probe("idle"))
    assert report.clean and report.problems == () and report.notes == ()
    assert [g.clean for g in report.gpus] == [True, True]


def test_busy_names_pid_566_and_keeps_gpu1_clean() -> None:
    report = gpus.evaluate(spec_for(), probe("busy"))
    assert not report.clean
    g0, g1 = report.gpus
    assert [p.pid for p in g0.processes] == [566]
    assert "PID 566" in g0.reasons[0] and "8710 MiB" in g0.reasons[0]
    assert g1.clean  # 4 MiB with no process is under the 64 MiB threshold
    message = gpus.gate_message(report)
    assert "566" in message and "fab gpus --wait" in message and "Nothing was killed" in message
    assert "fab stop" not in message  # not this project's run


def test_zombie_context_is_named() -> None:
    report = gpus.evaluate(spec_for(), probe("zombie"))
    (reason,) = report.gpus[0].reasons
    assert "8719 MiB in use with no owning process" in reason and "zombie" in reason
    assert report.gpus[1].clean
    assert any("retired pages / remapped rows not reported" in n for n in report.notes)


def test_threshold_is_configurable() -> None:
    strict = spec_for(gpu_gate=GateSpec(max_memory_mib=0))
    report = gpus.evaluate(strict, probe("busy"))
    assert "zombie" in report.gpus[1].reasons[0]  # 4 MiB > 0 MiB with no process


def test_ecc_and_remap_failures() -> None:
    ecc = gpus.evaluate(spec_for(), probe("ecc"))
    assert ecc.gpus[0].clean and "3 uncorrected volatile ECC" in ecc.gpus[1].reasons[0]
    remap = gpus.evaluate(spec_for(), probe("remap_failure"))
    assert remap.gpus[0].clean
    assert [r.split(":")[0] for r in remap.gpus[1].reasons] == [
        "row remapping failed", "remapped rows pending", "page retirement pending",
    ]  # fmt: skip


def test_gpu_count_against_topology() -> None:
    report = gpus.evaluate(spec_for(gpus=8, topology=Topology(5, 3)), probe("idle"))
    assert not report.clean
    assert "sees 2 GPU(s), expected 8 (targets.gputest.gpus (topology 5+3))" in report.problems[0]
    missing = gpus.evaluate(spec_for(), probe("missing_gpu"))
    assert "sees 1 GPU(s), expected 2" in missing.problems[0]
    lost = gpus.evaluate(spec_for(), probe("gpu_lost"))
    assert "GPU is lost" in lost.problems[0]


def test_expected_name() -> None:
    ok = gpus.evaluate(spec_for(gpu_gate=GateSpec(expected_name="H200")), probe("idle"))
    assert ok.clean
    bad = gpus.evaluate(spec_for(gpu_gate=GateSpec(expected_name="RTX PRO 6000")), probe("idle"))
    assert "expected 'RTX PRO 6000'" in bad.gpus[0].reasons[0]


def test_not_available_memory_is_not_clean() -> None:
    spec = spec_for(gpu_gate=GateSpec(expected_name="RTX PRO 6000"))
    report = gpus.evaluate(spec, probe("na_fields"))
    assert report.gpus[0].clean
    assert "memory.used not reported" in " ".join(report.gpus[1].reasons)
    assert [p.pid for p in report.gpus[1].processes] == [4242]


@pytest.mark.parametrize(
    ("scenario", "words"),
    [
        ("nvml_mismatch", "version mismatch"),
        ("no_driver", "NVIDIA driver"),
        ("no_devices", "sees 0 GPU(s), expected 2"),
    ],
)
def test_failed_nvidia_smi_is_not_clean(scenario: str, words: str) -> None:
    report = gpus.evaluate(spec_for(), probe(scenario))
    assert not report.clean and report.gpus == ()
    assert words in report.problems[0]


def test_container_target_takes_processes_from_the_host() -> None:
    spec = spec_for(container=ContainerSpec("pct", id=200))
    visible = probe("idle", "container 200", apps=False, xml=False)  # the container sees no PIDs
    report = gpus.evaluate(spec, visible, probe("busy", "host"))
    assert [p.pid for p in report.processes] == [566]
    assert report.gpus[0].memory_used_mib == 8719  # the host's numbers
    broken_host = Probe("host", Answer(127, "sh: 1: nvidia-smi: not found"))
    report = gpus.evaluate(spec, visible, broken_host)
    assert "host: `" in report.problems[0] and "not found" in report.problems[0]
    assert "not found by host's nvidia-smi" in report.gpus[0].reasons[0]  # unchecked is not clean
    mismatch = gpus.evaluate(spec, probe("nvml_mismatch", "container 200"), probe("idle", "host"))
    assert mismatch.problems[0].startswith("container 200: NVML driver/library version mismatch")


def test_report_text_and_json() -> None:
    report = gpus.evaluate(spec_for(), probe("busy"))
    text = report.text()
    for word in ("GPU", "name", "memory used/total", "util", "processes", "verdict", "8719 MiB / 143771 MiB"):
        assert word in text
    assert "566 python3" in text and "NOT CLEAN" in text.splitlines()[-1]
    data = json.loads(report.to_json())
    assert data["clean"] is False and data["gpus"][1]["clean"] is True
    assert data["gpus"][0]["processes"][0]["pid"] == 566
    clean = json.loads(gpus.evaluate(spec_for(), probe("idle")).to_json())
    assert clean["clean"] is True and clean["problems"] == []


# --- the gate for real on the local target (sh + shim + ps) ---------------------------------------


@pytest.fixture
def scenario(monkeypatch: pytest.MonkeyPatch) -> Iterator[callable]:  # type: ignore[valid-type]
    def use(path: Path | str) -> None:
        monkeypatch.setenv("FLEET_NVSMI_FIXTURE_DIR", str(FIXTURES / path))

    yield use


def run_gate(spec: TargetSpec) -> tuple[gpus.GateReport, list[str]]:
    said: list[str] = []
    with open_target(spec) as target:
        return gpus.gate(target, echo=said.append), said


def test_gate_idle_passes(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("idle")
    report, said = run_gate(spec_for(tmp_path))
    assert report.clean and said == ["gputest: 2 GPU(s) clean"]


def test_gate_busy_refuses_with_pid_566(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("busy")
    with pytest.raises(GpuGateError) as err:
        run_gate(spec_for(tmp_path))
    assert "PIDs 566" in str(err.value) and err.value.exit_code == 7
    assert "fab gpus --wait 600" in str(err.value)
    assert "\n" not in str(err.value)


def test_gate_hang_times_out(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("hang")
    spec = spec_for(tmp_path, gpu_gate=GateSpec(timeout_s=1))
    with pytest.raises(GpuGateError, match="did not answer within 1s"):
        run_gate(spec)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("missing", "not found (install the NVIDIA driver utilities or set commands.nvidia_smi)"),
        ("nvml_mismatch", "NVML driver/library version mismatch"),
        ("no_devices", "sees 0 GPU(s), expected 2"),
        ("remap_failure", "row remapping failed"),
    ],
)
def test_gate_failures(scenario, tmp_path: Path, name: str, words: str) -> None:  # type: ignore[no-untyped-def]
    scenario(name)
    with pytest.raises(GpuGateError, match=re.escape(words)):
        run_gate(spec_for(tmp_path))


def test_absent_nvidia_smi_binary(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, commands=Commands(nvidia_smi=str(tmp_path / "no-such-nvidia-smi")))
    with pytest.raises(GpuGateError, match=r"no-such-nvidia-smi` not found"):
        run_gate(spec)


def test_cpu_target_runs_nothing(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, gpus=0, commands=Commands(nvidia_smi=str(tmp_path / "absent")))
    report, said = run_gate(spec)
    assert report.clean and said == [gpus.CPU_LINE] == ["no GPUs configured: running on CPU"]


def busy_with(tmp_path: Path, pid: int) -> Path:
    """The busy capture with PID 566 replaced by a real process of this machine."""
    d = tmp_path / "busy-real"
    shutil.copytree(FIXTURES / "busy", d)
    (d / "apps.csv").write_text(read(d / "apps.csv").replace("566,", f"{pid},"))
    return d


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process whose command line names a run dir of the target (like the trainer's)."""
    run_dir = tmp_path / "work" / "runs" / "20260101T000000Z-tiny"
    code = "import time; time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code, "--run-dir", str(run_dir)], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_gate_shows_owner_and_suggests_fab_stop_for_our_run(scenario, tmp_path, sleeper) -> None:  # type: ignore[no-untyped-def]
    scenario(busy_with(tmp_path, sleeper.pid))
    with pytest.raises(GpuGateError) as err:
        run_gate(spec_for(tmp_path / "work"))
    assert f"PID {sleeper.pid} is this project's run: stop it with `fab stop`" in str(err.value)
    with open_target(spec_for(tmp_path / "work")) as target:
        report = gpus.check_gpus(target)
    (proc,) = report.processes
    assert proc.ours and "time.sleep(600)" in (proc.args or "")
    assert proc.user == subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    assert f"PID {sleeper.pid} on GPU 0 (this project run):" in report.text(width=400)


def test_recorded_pgid_marks_our_run(scenario, tmp_path, sleeper) -> None:  # type: ignore[no-untyped-def]
    scenario(busy_with(tmp_path, sleeper.pid))
    other = tmp_path / "elsewhere"
    latest = other / "runs" / "latest"
    latest.mkdir(parents=True)
    (latest / "pgid").write_text(f"{sleeper.pid}\n")  # start_new_session: pgid == pid
    with open_target(spec_for(other)) as target:
        assert [p.ours for p in gpus.check_gpus(target).processes] == [True]
    (latest / "pgid").write_text("1234567\n")
    with open_target(spec_for(other)) as target:
        assert [p.ours for p in gpus.check_gpus(target).processes] == [False]


def test_wait_polls_until_clean(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("busy")
    polls: list[gpus.GateReport] = []

    def on_poll(report: gpus.GateReport) -> None:
        polls.append(report)
        scenario("idle")  # the other job ends while we wait

    with open_target(spec_for(tmp_path)) as target:
        report = gpus.wait_clean(target, 600, interval_s=0, on_poll=on_poll, sleep=lambda s: None)
    assert report.clean and len(polls) == 1 and not polls[0].clean


def test_wait_gives_up_at_the_deadline(scenario, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scenario("busy")
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    with open_target(spec_for(tmp_path)) as target:
        report = gpus.wait_clean(target, 12, interval_s=5, sleep=sleep, clock=lambda: now[0])
        assert not report.clean and slept == [5, 5, 2]
        with pytest.raises(
            FleetError, match=r"GPUs not clean after waiting 0\.01s: GPU 0: compute process PID 566"
        ):
            gpus.gpus_task(target, wait_s=0.01)


# --- the shim itself --------------------------------------------------------------------------------


def shim(*args: str, env: dict[str, str] | None = None, exe: Path = SHIM) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "FLEET_NVSMI_FIXTURE_DIR"} | (env or {})
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=full, timeout=30, check=False
    )


def test_shim_answers_only_fleets_queries() -> None:
    env = {"FLEET_NVSMI_FIXTURE_DIR": str(FIXTURES / "busy")}
    ok = shim(f"--query-compute-apps={','.join(gpus.APPS_FIELDS)}", "--format=csv", env=env)
    assert (ok.returncode, ok.stdout) == (0, read(REAL / "apps_busy.csv"))
    assert shim("--query-gpu=index,uuid", "--format=csv", env=env).returncode == 2
    assert shim("-L", env=env).returncode == 2
    assert shim(env=env).stdout == read(REAL / "busy.txt")
    assert shim("-q", "-x", env={"FLEET_NVSMI_FIXTURE_DIR": str(FIXTURES / "zombie")}).returncode == 3
    mismatch = shim("-q", "-x", env={"FLEET_NVSMI_FIXTURE_DIR": str(FIXTURES / "nvml_mismatch")})
    assert mismatch.returncode == 18 and mismatch.stdout.startswith("Failed to initialize NVML")


def test_shim_fixture_file_next_to_it(tmp_path: Path) -> None:
    exe = tmp_path / "nvidia-smi"
    shutil.copy2(SHIM, exe)
    none = shim("-q", "-x", exe=exe)
    assert none.returncode == 255 and "no fixture" in none.stderr
    shutil.copytree(FIXTURES / "idle", tmp_path / "fx")
    (tmp_path / "nvidia-smi.fixture").write_text("fx\n")  # relative to the shim's directory
    got = shim(f"--query-gpu={','.join(gpus.QUERY_FIELDS)}", "--format=csv", exe=exe)
    assert (got.returncode, got.stdout) == (0, read(REAL / "query_idle.csv"))


# --- the real `fab` on a local GPU target ------------------------------------------------------------


def local_inventory(tmp_path: Path) -> Path:
    from testkit import render_inventory

    target = {
        "host": "local",
        "workdir": str(tmp_path / "work"),
        "gpus": 2,
        "env": "",
        "commands": {"nvidia_smi": str(SHIM)},
        "gpu_gate": {"timeout_s": 10},
    }
    config = tmp_path / "fleet.toml"
    config.write_text(render_inventory({"gpubox": target}, "gpubox"))
    return config


def fab(config: Path, scenario_name: str, *args: str) -> subprocess.CompletedProcess[str]:
    from testkit import fab as run

    return run(
        *args, config=config, timeout=120, env={"FLEET_NVSMI_FIXTURE_DIR": str(FIXTURES / scenario_name)}
    )


def test_fab_gpus_exit_codes_and_json(tmp_path: Path) -> None:
    config = local_inventory(tmp_path)
    clean = fab(config, "idle", "gpus")
    assert clean.returncode == 0 and "gpubox: CLEAN" in clean.stdout, clean.stdout + clean.stderr
    busy = fab(config, "busy", "gpus")
    assert busy.returncode == 1 and "566 python3" in busy.stdout
    (line,) = [ln for ln in busy.stderr.splitlines() if ln.strip()]
    assert line == "fleet: gpubox: GPUs not clean: GPU 0: compute process PID 566 (python3, 8710 MiB)"
    as_json = fab(config, "busy", "gpus", "--json")
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["gpus"][0]["processes"][0]["pid"] == 566
    bad = fab(config, "idle", "gpus", "--wait", "-1")
    assert bad.returncode == 2 and "give seconds >= 0" in bad.stderr


def test_fab_train_refuses_on_busy_gpus(tmp_path: Path, local_tmux) -> None:  # type: ignore[no-untyped-def]
    config = local_inventory(tmp_path)
    refused = fab(config, "busy", "train")
    assert refused.returncode == 7, refused.stdout + refused.stderr
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert line.startswith("fleet: gpubox: GPUs not clean (PIDs 566), not launching:"), line
    assert "fab gpus --wait 600" in line and "Traceback" not in refused.stderr
    assert local_tmux.run("has-session", "-t", "fleet-run", check=False).returncode != 0
    assert not (tmp_path / "work" / "runs").exists()
