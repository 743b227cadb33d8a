"""fleet.envs / fleet.env_drift / the shipped env_probe: pure parsers, then the local target with
real uv and real venvs (the small `smoke` env: two pure-Python packages, warm uv cache after the
first download)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fleet import envs
from fleet.env_drift import (
    DistDiff,
    DriftReport,
    LockedPackage,
    diff_env,
    normalize_version,
    parse_lock,
    parse_uv_check,
)
from fleet.errors import ConfigError, EnvError
from fleet.inventory import Commands, TargetSpec
from fleet.remote import env_probe
from fleet.target import open_target

REPO = Path(__file__).resolve().parents[2]
SHARED_SMI = REPO.parent / "shared" / "fixtures" / "nvidia-smi" / "h200x2" / "idle.txt"
UV_CHECK_DRIFT = """\
Would use project environment at: final
Resolved 3 packages in 0.85ms
Would uninstall 2 packages
Would install 1 package
 - attrs==26.1.0
 - six==1.16.0
 + six==1.17.0
error: The environment is outdated; run `uv sync` to update the environment
"""


def _uv() -> str | None:
    """The uv fleet uses here (the controller venv's own, else PATH's), or None."""
    try:
        return envs.controller_uv()[0]
    except EnvError:
        return None


UV = _uv()


# --- pure ----------------------------------------------------------------------------------------


def test_parse_lock_of_shipped_envs() -> None:
    train = parse_lock((REPO / "envs/train/uv.lock").read_text())
    assert train["torch"].version == "2.11.0"
    assert train["transformers"].version == "5.8.1"
    assert "wandb" in train and "fleet-env-train" not in train  # the virtual project is left out
    cpu = parse_lock((REPO / "envs/local-cpu/uv.lock").read_text())
    assert cpu["torch"] == LockedPackage("torch", "2.13.0", "registry")
    root = parse_lock((REPO / "uv.lock").read_text())
    for name in ("torch", "transformers", "datasets", "tokenizers", "numpy"):
        assert cpu[name].version == root[name].version  # the same versions as the controller


@pytest.mark.parametrize("name", ["smoke", "local-cpu", "train"])
def test_shipped_locks_match_their_pyproject(name: str) -> None:
    """`uv lock --check` (envs/README.md): each shipped uv.lock is current for its pyproject.toml."""
    if UV is None:
        pytest.skip("uv not installed")
    done = subprocess.run(
        [UV, "lock", "--check"], cwd=REPO / "envs" / name, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


def test_parse_lock_rejects_garbage() -> None:
    with pytest.raises(EnvError, match=r"not a valid uv.lock"):
        parse_lock("[[package]\nname=", "envs/x/uv.lock")


def test_diff_env_names_every_kind_of_drift() -> None:
    lock = {
        "torch": LockedPackage("torch", "2.11.0+cu130", "registry"),
        "transformers": LockedPackage("transformers", "5.8.1", "registry"),
        "six": LockedPackage("six", "1.17.0", "registry"),
        "colorama": LockedPackage("colorama", "0.4.6", "registry"),
    }
    installed = [
        {
            "name": "torch",
            "version": "2.11.0+cu128",
            "installer": "uv",
            "dist_info": "torch-2.11.0+cu128.dist-info",
        },
        {
            "name": "transformers",
            "version": "5.8.1",
            "installer": "pip",
            "dist_info": "transformers-5.8.1.dist-info",
        },
        {"name": "sglang", "version": "0.5.0", "installer": "pip", "dist_info": "sglang-0.5.0.dist-info"},
        {
            "name": "Flash_Infer",
            "version": "0.2",
            "installer": "uv",
            "dist_info": "flash_infer-0.2.dist-info",
        },
    ]
    modified = [
        {"dist": "transformers-5.8.1.dist-info", "path": "transformers/x.py", "reason": "sha256 differs"}
    ]
    d = diff_env(lock, ["torch", "transformers", "six"], installed, modified)
    assert [x.name for x in d["extra"]] == ["flash-infer", "sglang"]
    assert "installed by pip" in d["extra"][1].detail
    assert d["missing"] == (DistDiff("six", "1.17.0", "", "not installed"),)
    assert d["changed"] == (
        DistDiff("torch", "2.11.0+cu130", "2.11.0+cu128", "version differs from the lock"),
    )
    assert [(x.name, x.found) for x in d["installer"]] == [("transformers", "pip")]
    assert [(x.name, x.found) for x in d["modified"]] == [("transformers", "transformers/x.py")]
    report = DriftReport("t", "train", "/w/envs/train-x", "x", **d)
    assert report.drift
    summary = report.summary()
    assert "sglang==0.5.0" in summary and "torch 2.11.0+cu130 -> 2.11.0+cu128" in summary
    data = json.loads(report.to_json_text())
    assert data["drift"] is True and {"extra", "missing", "changed"} <= data.keys()
    assert "DRIFT" in report.text() and "sglang" in report.text()


def test_clean_report_and_version_normalization() -> None:
    lock = {"six": LockedPackage("six", "1.17.0", "registry")}
    d = diff_env(lock, ["six"], [{"name": "six", "version": "1.17.0", "installer": "uv"}], [])
    report = DriftReport("t", "smoke", "/p", "h", **d)
    assert not report.drift and "no drift" in report.text()
    assert normalize_version("2.11.0+CU128") == "2.11.0+cu128" != normalize_version("2.11.0+cu130")


def test_parse_uv_check_on_recorded_output() -> None:
    status, lines = parse_uv_check(1, UV_CHECK_DRIFT)
    assert status == "drift" and lines == ("- attrs==26.1.0", "- six==1.16.0", "+ six==1.17.0")
    assert parse_uv_check(0, "Would make no changes\n") == ("ok", ())
    status, _ = parse_uv_check(2, "error: No interpreter found\n")
    assert status.startswith("unavailable: error: No interpreter found")


def test_driver_cuda_from_recorded_nvidia_smi_and_mismatch() -> None:
    text = (
        SHARED_SMI.read_text()
        if SHARED_SMI.exists()
        else (REPO / "tests/fixtures/nvidia-smi/idle/table.txt").read_text()
    )
    driver = envs.driver_cuda(text)
    assert driver is not None and driver[0] >= 12
    assert envs.cuda_mismatch("13.0", (13, 0)) == ""
    assert envs.cuda_mismatch("12.8", (13, 0)) == ""
    assert envs.cuda_mismatch("", (12, 4)) == ""  # a CPU build runs anywhere
    why = envs.cuda_mismatch("13.0", (12, 8))
    assert "CUDA 13.0" in why and "12.8" in why
    assert envs.driver_cuda("NVIDIA-SMI has failed") is None


def test_env_hash_depends_on_lock_python_and_platform() -> None:
    interp = {
        "implementation": "cpython",
        "version": "3.11.7",
        "system": "Linux",
        "machine": "x86_64",
        "libc": "glibc-2.36",
    }
    base = envs.env_hash(b"lock", interp)
    assert len(base) == envs.HASH_LEN and base == envs.env_hash(b"lock", dict(interp))
    assert envs.env_hash(b"lock2", interp) != base
    assert envs.env_hash(b"lock", {**interp, "version": "3.11.8"}) != base
    assert envs.env_hash(b"lock", {**interp, "machine": "aarch64"}) != base


def test_load_env_def_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"envs/nope/pyproject.toml|missing"):
        envs.load_env_def(tmp_path, "nope")
    (tmp_path / "envs/x").mkdir(parents=True)
    (tmp_path / "envs/x/pyproject.toml").write_text('[project]\nname = "x"\n')
    (tmp_path / "envs/x/uv.lock").write_text("version = 1\n")
    with pytest.raises(ConfigError, match="requires-python"):
        envs.load_env_def(tmp_path, "x")
    assert envs.load_env_def(REPO, "train").has_torch
    assert not envs.load_env_def(REPO, "smoke").has_torch


def test_probe_parse_record_handles_quoted_paths() -> None:
    rows = env_probe.parse_record('a/b.py,sha256=abc,12\n"odd,name.py",sha256=def,3\nx.dist-info/RECORD,,\n')
    assert rows == [
        ("a/b.py", "sha256=abc", 12),
        ("odd,name.py", "sha256=def", 3),
        ("x.dist-info/RECORD", "", None),
    ]


def test_python_for() -> None:
    spec = TargetSpec(name="t", host="local", workdir="/w", env="train")
    assert envs.python_for(spec) == "/w/envs/train/current/bin/python"
    assert envs.python_for(TargetSpec(name="t", host="local", workdir="/w")) == "python3"


# --- the local target, real uv -------------------------------------------------------------------

needs_uv = pytest.mark.skipif(UV is None, reason="uv not installed (./bootstrap installs it into .venv)")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repo root with the shipped smoke env and a `broken` one whose lock cannot be installed."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "envs" / "smoke", root / "envs" / "smoke")
    return root


def _spec(workdir: Path, env: str = "smoke", **commands: str) -> TargetSpec:
    return TargetSpec(name="t", host="local", workdir=str(workdir), env=env, commands=Commands(**commands))


def _break_lock(repo: Path) -> None:
    """Make the smoke lock unsatisfiable: no file matches idna's pinned hashes any more."""
    lock = repo / "envs/smoke/uv.lock"
    text = lock.read_text()
    start = text.index('\nname = "idna"\n')
    end = text.index("[[package]]", start)
    block = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, text[start:end])
    lock.write_text(text[:start] + block + text[end:])


def _py(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([path, *args], capture_output=True, text=True, check=False)


def _uv_pip(python: str, *args: str) -> None:
    env = {**os.environ, "UV_SYSTEM_CERTS": "1"}  # as fleet's own uv calls: the machine's CA store
    subprocess.run([UV, "pip", "install", "-q", "--python", python, *args], check=True, env=env)  # type: ignore[list-item]


@needs_uv
def test_ensure_env_builds_once_and_records_a_manifest(tmp_path: Path, repo: Path) -> None:
    with open_target(_spec(tmp_path / "wd")) as target:
        info = envs.ensure_env(target, repo)
        assert info.built and info.managed and info.path.endswith(f"smoke-{info.env_hash}")
        assert (
            _py(
                info.python, "-I", str(envs.PROBE), "verify", "--import", "six", "--import", "idna"
            ).returncode
            == 0
        )
        manifest = json.loads((Path(info.path) / "fleet-env/manifest.json").read_text())
        assert manifest["installed"] == {"idna": "3.10", "six": "1.17.0"}
        assert manifest["lock_sha256"] == envs.load_env_def(repo, "smoke").lock_sha256
        assert manifest["verified"] and manifest["python"] and manifest["build_seconds"] >= 0
        assert os.readlink(tmp_path / "wd/envs/smoke/current") == f"../smoke-{info.env_hash}"
        again = envs.ensure_env(target, repo)
        assert not again.built and again.path == info.path
        assert not list((tmp_path / "wd/envs").glob(".staging-*"))


@needs_uv
def test_drift_rebuild_failed_rebuild_rollback_gc(tmp_path: Path, repo: Path) -> None:
    wd = tmp_path / "wd"
    with open_target(_spec(wd)) as target:
        first = envs.ensure_env(target, repo)
        assert not envs.check_env(target, repo).drift
        # drift: an extra package, another version of a locked one, an edit in place (same size)
        _uv_pip(first.python, "attrs", "six==1.16.0")
        core = next(Path(first.path).glob("lib/python3.*/site-packages/idna/core.py"))
        data = core.read_bytes()
        core.write_bytes(data.replace(b"import", b"IMPORT", 1))
        report = envs.check_env(target, repo)
        assert report.drift and report.uv_check == "drift"
        assert [d.name for d in report.extra] == ["attrs"]
        assert [(d.name, d.expected, d.found) for d in report.changed] == [("six", "1.17.0", "1.16.0")]
        assert [(d.name, d.found) for d in report.modified] == [("idna", "idna/core.py")]
        with pytest.raises(EnvError, match="fab env-rebuild"):
            envs.ensure_env(target, repo)
        # rebuild: passes, the drifted venv is still on disk but not current
        fresh = envs.rebuild_env(target, repo)
        assert fresh.built and fresh.path != first.path and fresh.env_hash == first.env_hash
        assert not envs.check_env(target, repo).drift
        assert Path(first.path, "lib").is_dir()
        assert os.readlink(wd / "envs/smoke/previous") == f"../{Path(first.path).name}"
        # a rebuild that cannot succeed leaves the current env current and importable
        _break_lock(repo)
        with pytest.raises(EnvError, match=r"uv sync --locked.*current env is unchanged"):
            envs.rebuild_env(target, repo)
        assert os.readlink(wd / "envs/smoke/current") == f"../{Path(fresh.path).name}"
        assert (
            _py(
                fresh.python, "-I", str(envs.PROBE), "verify", "--import", "six", "--import", "idna"
            ).returncode
            == 0
        )
        assert not list((wd / "envs").glob(".staging-*"))
        # rollback goes to the previous (drifted) one, and back
        back = envs.rollback_env(target)
        assert (
            back.path == first.path
            and os.readlink(wd / "envs/smoke/current") == f"../{Path(first.path).name}"
        )
        again = envs.rollback_env(target)
        assert again.path == fresh.path
        # gc: an unreferenced build goes; current, previous, run-referenced and in-use ones stay
        shutil.copytree(first.path, wd / f"envs/smoke-{'a' * 16}", symlinks=True)
        shutil.copytree(wd / f"envs/smoke-{'a' * 16}", wd / f"envs/smoke-{'b' * 16}", symlinks=True)
        shutil.copytree(wd / f"envs/smoke-{'a' * 16}", wd / f"envs/smoke-{'c' * 16}", symlinks=True)
        (wd / "runs/r1").mkdir(parents=True)
        (wd / "runs/r1/run.json").write_text(
            json.dumps({"python": str(wd / f"envs/smoke-{'b' * 16}/bin/python")})
        )
        held = wd / f"envs/smoke-{'c' * 16}/fleet-env/uv.lock"
        holder = subprocess.Popen(["tail", "-f", str(held)], stdout=subprocess.DEVNULL)  # a live user
        try:
            _wait_until_open(holder.pid, held)
            assert envs.gc_envs(target) == [f"smoke-{'a' * 16}"]
        finally:
            holder.kill()
            holder.wait()
        # the build lock's file stays (an flock on it is the lock; removing it would race a waiter)
        left = sorted(p.name for p in (wd / "envs").iterdir() if not p.name.startswith(".build-"))
        kept = [Path(first.path).name, Path(fresh.path).name, f"smoke-{'b' * 16}", f"smoke-{'c' * 16}"]
        assert left == sorted(["smoke", *kept])


def _open_files(pid: int) -> set[str]:
    """What ``pid``'s descriptors point at now; one closed between the listing and its readlink
    (a starting ``tail`` opens and closes a few) is simply not there."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            found.add(os.readlink(fd))
        except FileNotFoundError:
            continue
    return found


def _wait_until_open(pid: int, path: Path) -> None:
    """Block until process ``pid`` holds ``path`` open (bounded; not a speed assertion)."""
    for _ in range(200):
        if str(path) in _open_files(pid):
            return
        time.sleep(0.05)
    pytest.fail(f"pid {pid} never opened {path}")


@needs_uv
def test_env_errors_are_one_clear_line(tmp_path: Path, repo: Path) -> None:
    with open_target(_spec(tmp_path / "wd")) as target:
        with pytest.raises(EnvError, match=r"not built.*fab env-rebuild"):
            envs.check_env(target, repo)
        with pytest.raises(EnvError, match="no previous build"):
            envs.rollback_env(target)
    with open_target(_spec(tmp_path / "wd", tmux="/nonexistent/tmux")) as target:
        with pytest.raises(EnvError, match=r"tmux is not installed.*commands.tmux"):
            envs.ensure_env(target, repo)
    with open_target(TargetSpec(name="t", host="local", workdir=str(tmp_path / "wd2"))) as target:
        assert envs.ensure_env(target, repo) == envs.EnvInfo("t", "", False, "python3")
        with pytest.raises(EnvError, match="no managed env"):
            envs.check_env(target, repo)


@needs_uv
def test_uv_is_pushed_when_the_target_has_none(tmp_path: Path, repo: Path) -> None:
    wd = tmp_path / "wd"
    with open_target(_spec(wd, uv="/nonexistent/uv")) as target:
        info = envs.ensure_env(target, repo)
    pushed = wd / "bin/uv"
    assert pushed.is_file() and os.access(pushed, os.X_OK)
    assert _py(str(pushed), "--version").stdout.split()[1] == envs.controller_uv()[1]
    manifest = json.loads((Path(info.path) / "fleet-env/manifest.json").read_text())
    assert manifest["uv"] == str(pushed)


def test_parse_provision() -> None:
    text = (
        "machine\tx86_64\ntmux\ttmux 3.3a\n"
        "uv\tuv\tuv 0.13.9 (x86_64-unknown-linux-gnu)\nuv\t/w/bin/uv\tuv 0.11.0\n"
    )
    facts = envs.parse_provision(text)
    assert facts == envs.ProvisionFacts("x86_64", "tmux 3.3a", {"uv": "0.13.9", "/w/bin/uv": "0.11.0"})
    assert envs.parse_provision("machine\taarch64\n") == envs.ProvisionFacts("aarch64", "", {})


def _controller_venv_has_torch() -> bool:
    return any((REPO / ".venv/lib").glob("python3.*/site-packages/torch/__init__.py"))


@pytest.mark.skipif(not _controller_venv_has_torch(), reason="the dev venv has no torch")
@pytest.mark.parametrize(
    ("fixture", "message"),
    [("idle", r"cannot see the GPUs.*not switched"), ("no_driver", r"gave no CUDA version")],
)
def test_gpu_target_verification_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture: str, message: str
) -> None:
    """A GPU target: the real torch (the dev venv's) is imported by the shipped probe, the
    driver's CUDA version read from nvidia-smi (shim, recorded output); a torch that cannot use the
    GPUs, or a driver that does not answer, is refused before any switch."""
    monkeypatch.setenv("FLEET_NVSMI_FIXTURE_DIR", str(REPO / "tests/fixtures/nvidia-smi" / fixture))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    def_dir = tmp_path / "def"
    def_dir.mkdir()
    shutil.copy(envs.PROBE, def_dir / "env_probe.py")
    spec = TargetSpec(
        name="t",
        host="local",
        workdir=str(tmp_path / "wd"),
        gpus=1,
        env="local-cpu",
        commands=Commands(nvidia_smi=str(REPO / "tests/shims/nvidia-smi")),
    )
    env_def = envs.load_env_def(REPO, "local-cpu")
    with open_target(spec) as target, pytest.raises(EnvError, match=message):
        envs._verify(target, env_def, str(REPO / ".venv"), str(def_dir))


def test_probe_reads_name_and_version_from_the_metadata_head_only() -> None:
    text = "Metadata-Version: 2.4\nName: Flash_Infer\nVersion: 0.2.0+cu128\n\nName: not-this\n"
    assert env_probe.parse_metadata_head(text.splitlines(keepends=True)) == ("Flash_Infer", "0.2.0+cu128")
    assert env_probe.parse_metadata_head(["Summary: x\n", "\n", "Name: late\n"]) == ("", "")
