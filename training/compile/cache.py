"""The compile cache of a run: one directory per (env, torch, triton, GPU type, CUDA) key.

Layout (``root`` = ``<workdir>/compile-cache``, handed to every training process by
``fleet/runs.py`` as ``$FLEET_COMPILE_CACHE``)::

    <root>/<key>/inductor/       TORCHINDUCTOR_CACHE_DIR (FX graph + AOTAutograd caches, C++/Triton code)
    <root>/<key>/triton/         TRITON_CACHE_DIR (compiled Triton kernels: inductor's and the target's
                                 linear-attention kernels, with their ``*.autotune.json`` results)
    <root>/<key>/megacache.bin   torch.compiler.save_cache_artifacts() of the last warm-up
    <root>/<key>/manifest.json   what the warm-up compiled (``Manifest``); complete: true at the end

The key is ``<lock>-torch<ver>-triton<ver>-<device>-cuda<ver>``: the env's lock hash (from
the env manifest ``fleet-env/manifest.json`` next to or inside the venv; ``nolock`` outside a
fleet env), torch and triton versions, the device *type* (GPU name + compute capability, or
``cpu-<arch>``; never the index) and torch's CUDA version. Inductor keys its own entries on
much of this too; a key of our own keeps the caches of different envs apart and lets old
ones be deleted whole. ``TRITON_CACHE_DIR`` is always set explicitly: inductor's default
Triton dir is ``<cache>/triton/<device index>``, which would keep ``cuda:5`` from sharing what
``cuda:0`` compiled.

``activate()`` is called by every training process before its first compile: it sets both
variables (in ``os.environ``, so inductor's compile workers inherit them) and loads the
Mega-Cache blob when the key has a complete manifest. ``CounterReporter`` emits the
``compile_cache`` event (torch's cache hit/miss counters) at the first step and whenever
they change later, so a warm start that still compiles is visible in ``fab status``.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import sys
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from training.contract import (
    COMPILE_AUTOTUNE_FILE,
    COMPILE_BLOB_FILE,
    COMPILE_CACHE_ENV,
    COMPILE_MANIFEST_FILE,
)

ROOT_ENV = COMPILE_CACHE_ENV
MANIFEST_FILE = COMPILE_MANIFEST_FILE
BLOB_FILE = COMPILE_BLOB_FILE
AUTOTUNE_FILE = COMPILE_AUTOTUNE_FILE
AUTOTUNE_GLOB = "*.autotune.json"  # Triton's autotune results on disk (Autotuner cache_results)
ENV_MANIFEST = Path("fleet-env") / "manifest.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")

# torch 2.13's counter names (torch/_inductor/codecache.py, torch/_functorch/_aot_autograd/
# autograd_cache.py) -> the compile_cache event's fields (training/EVENTS.md).
COUNTERS: dict[str, tuple[str, str]] = {
    "fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
    "aotautograd_hit": ("aot_autograd", "autograd_cache_hit"),
    "aotautograd_miss": ("aot_autograd", "autograd_cache_miss"),
}


def _safe(text: str) -> str:
    return _UNSAFE.sub("-", text.strip()).strip("-") or "unknown"


@dataclass(frozen=True)
class CacheKey:
    """What a compiled artifact depends on, outside the code itself."""

    lock: str  # env lock hash (12 hex) or "nolock"
    torch: str
    triton: str  # "none" when triton is not installed (CPU wheels)
    device: str  # "NVIDIA-H200-sm90" / "cpu-x86_64"
    cuda: str  # torch.version.cuda or "none"

    @property
    def text(self) -> str:
        """The directory name: ``<lock>-torch<ver>-triton<ver>-<device>-cuda<ver>``."""
        parts = (self.lock, f"torch{self.torch}", f"triton{self.triton}", self.device, f"cuda{self.cuda}")
        return "-".join(_safe(p) for p in parts)


def env_lock_hash(prefix: Path | None = None) -> str:
    """The lock hash of the fleet env this interpreter runs in, else ``nolock``.

    fleet's env builds keep ``fleet-env/manifest.json`` (``lock_sha256``) beside the venv;
    both ``<prefix>/fleet-env`` and ``<prefix>/../fleet-env`` are looked at.
    """
    base = Path(prefix or sys.prefix)
    for folder in (base, base.parent):
        path = folder / ENV_MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        value = data.get("lock_sha256") or data.get("env_hash") if isinstance(data, dict) else None
        if isinstance(value, str) and value:
            return _safe(value)[:12]
    return "nolock"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def device_label(device: torch.device) -> str:
    """The device type without its index: ``<GPU name>-sm<major><minor>`` or ``cpu-<arch>``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{_safe(torch.cuda.get_device_name(index))}-sm{major}{minor}"
    return f"{device.type}-{_safe(platform.machine() or 'unknown')}"


def cache_key(device: torch.device, *, prefix: Path | None = None) -> CacheKey:
    """The key of this interpreter + ``device``."""
    return CacheKey(
        lock=env_lock_hash(prefix),
        torch=torch.__version__,
        triton=triton_version(),
        device=device_label(device),
        cuda=str(torch.version.cuda or "none"),
    )


@dataclass(frozen=True)
class ShapeRecord:
    """One warmed shape: length bucket, batch size, padded length, and the seconds it took."""

    bucket: int
    batch_size: int
    length: int
    seconds: float = 0.0


@dataclass(frozen=True)
class Manifest:
    """``<key>/manifest.json``: what the warm-up compiled into this key's cache."""

    key: str
    config: str
    config_hash: str
    buckets: tuple[int, ...]  # bucket boundaries
    shapes: tuple[ShapeRecord, ...]
    variants: int
    recompile_limit: int
    seconds: float
    torch: str
    triton: str
    device: str
    blob_bytes: int
    created_at: str
    complete: bool
    counters: Mapping[str, int] = field(default_factory=dict)
    # The target's linear-attention kernels at warm-up: "yes" (their Triton code and autotune results
    # are in triton/, one target forward per shape in ``target_shapes``), "no" (the torch fallback:
    # nothing to warm), "n/a" (no linear attention, or no GPU), "" (a manifest that predates this).
    target_fast_path: str = ""
    target_shapes: tuple[ShapeRecord, ...] = ()
    # The target's forward compiled per shape (compile.target, a dense target): ``target_shapes``
    # are then the compiled forward's warm-up.
    target_compiled: bool = False

    def to_json(self) -> str:
        data = asdict(self)
        data["counters"] = dict(self.counters)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest (ValueError when it is not one)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("manifest is not a JSON object")
        try:
            shapes = tuple(ShapeRecord(**s) for s in data.pop("shapes"))
            target_shapes = tuple(ShapeRecord(**s) for s in data.pop("target_shapes", ()))
            buckets = tuple(int(b) for b in data.pop("buckets"))
            counters = {str(k): int(v) for k, v in dict(data.pop("counters", {})).items()}
            return cls(shapes=shapes, buckets=buckets, counters=counters, target_shapes=target_shapes, **data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"manifest fields: {exc}") from None


@dataclass(frozen=True)
class CacheDir:
    """One key's directory under the cache root."""

    root: Path
    key: CacheKey

    @property
    def path(self) -> Path:
        return self.root / self.key.text

    @property
    def inductor_dir(self) -> Path:
        return self.path / "inductor"

    @property
    def triton_dir(self) -> Path:
        return self.path / "triton"

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE

    @property
    def blob_path(self) -> Path:
        return self.path / BLOB_FILE

    @property
    def autotune_path(self) -> Path:
        return self.path / AUTOTUNE_FILE

    def manifest(self) -> Manifest | None:
        """The manifest, or None when missing or unreadable (a half-written one is ignored)."""
        try:
            return Manifest.from_json(self.manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def complete_manifest(self, config_hash: str | None = None) -> Manifest | None:
        """The manifest when complete (and, given ``config_hash``, made for that config)."""
        manifest = self.manifest()
        if manifest is None or not manifest.complete or not self.blob_path.is_file():
            return None
        if config_hash is not None and manifest.config_hash != config_hash:
            return None
        return manifest

    def write_manifest(self, manifest: Manifest) -> Path:
        _atomic_write(self.manifest_path, manifest.to_json().encode())
        return self.manifest_path


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


@dataclass(frozen=True)
class ActiveCache:
    """What ``activate`` did: the key dir in use and the blob it loaded (0 bytes: none)."""

    cache: CacheDir
    manifest: Manifest | None
    blob_bytes: int
    blob_entries: int
    load_seconds: float

    def line(self) -> str:
        head = f"compile cache {self.cache.path}"
        if self.blob_bytes:
            return (
                f"{head}: loaded Mega-Cache blob ({self.blob_bytes / 1e6:.1f} MB, {self.blob_entries} "
                f"entries, {self.load_seconds:.1f}s)"
            )
        warmed = "warmed" if self.manifest is not None else "not warmed (`fab warm`)"
        return f"{head}: {warmed}"


def resolve_root(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The cache root: ``explicit``, else ``$FLEET_COMPILE_CACHE``, else None (torch's default)."""
    value = os.fspath(explicit) if explicit else os.environ.get(ROOT_ENV, "")
    return Path(value).expanduser().resolve() if value else None


def set_cache_env(cache: CacheDir) -> None:
    """Point inductor and Triton at ``cache`` (process env: compile workers inherit it)."""
    cache.inductor_dir.mkdir(parents=True, exist_ok=True)
    cache.triton_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.inductor_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache.triton_dir)


def load_blob(path: Path) -> tuple[int, int]:
    """``torch.compiler.load_cache_artifacts`` of a saved blob: (bytes, entries loaded)."""
    data = path.read_bytes()
    info = torch.compiler.load_cache_artifacts(data)
    entries = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
    return len(data), entries


def save_blob(path: Path) -> tuple[int, int]:
    """``torch.compiler.save_cache_artifacts`` of this process into ``path``: (bytes, entries)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0, 0
    data, info = saved
    _atomic_write(path, data)
    return len(data), sum(len(v) for v in info.artifacts.values())


def pack_autotune(cache: CacheDir) -> int:
    """Write ``autotune.tar``: every Triton autotune result under the key's triton/ dir, by its path
    there (the target's own kernels: the Mega-Cache blob holds inductor's kernels, not these).
    Returns how many; with none, no file (and an older one removed)."""
    found = sorted(cache.triton_dir.rglob(AUTOTUNE_GLOB)) if cache.triton_dir.is_dir() else []
    if not found:
        cache.autotune_path.unlink(missing_ok=True)
        return 0
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in found:
            archive.add(path, arcname=path.relative_to(cache.triton_dir).as_posix(), recursive=False)
    _atomic_write(cache.autotune_path, buffer.getvalue())
    return len(found)


def unpack_autotune(cache: CacheDir) -> int:
    """Put ``autotune.tar``'s results into the key's triton/ dir where they are missing (a second
    host's first hybrid forward then compiles the chosen configs instead of benchmarking every
    one). Only regular ``*.autotune.json`` files inside the dir are taken. Returns how many."""
    try:
        archive = tarfile.open(cache.autotune_path)
    except (OSError, tarfile.TarError):
        return 0
    added = 0
    with archive:
        for member in archive.getmembers():
            dest = (cache.triton_dir / member.name).resolve()
            inside = dest.is_relative_to(cache.triton_dir.resolve())
            if not (member.isfile() and inside and dest.match(AUTOTUNE_GLOB)) or dest.exists():
                continue
            data = archive.extractfile(member)
            if data is not None:
                dest.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(dest, data.read())
                added += 1
    return added


def activate(
    root: Path, device: torch.device, *, load: bool = True, prefix: Path | None = None
) -> ActiveCache:
    """Use ``root/<key>`` for this process; load its Mega-Cache blob when the key is warmed.

    Call before the first ``torch.compile`` call runs. ``load=False`` (the warm-up itself)
    only sets the directories.
    """
    cache = CacheDir(root, cache_key(device, prefix=prefix))
    set_cache_env(cache)
    manifest = cache.complete_manifest()
    if manifest is not None:
        unpack_autotune(cache)  # the target's kernels' results, for target ranks too (load=False)
    if not load or manifest is None:
        return ActiveCache(cache, manifest, 0, 0, 0.0)
    started = time.monotonic()
    size, entries = load_blob(cache.blob_path)
    return ActiveCache(cache, manifest, size, entries, time.monotonic() - started)


def start_workers(device: torch.device) -> bool:
    """Start inductor's compile workers now, in a process that will compile on ``device``; True
    when they were started.

    Inductor compiles a graph's Triton kernels in a pool of worker processes, but only once the
    pool answers: until then each kernel compiles in the training process itself, one after the
    other. Left to itself the pool starts at the first compile, so the first graphs of a cold
    start compiled their kernels serially while the workers were still importing torch. Started
    here, before the data and the target load, the workers are ready by the first step. The
    key's cache dirs are set first (the workers inherit the environment they start with), as
    ``activate`` sets them again later. torch's private ``maybe_warm_pool`` is what its own
    inductor backend calls at the first compile (``torch/_dynamo/backends/inductor.py``);
    without it (another torch) nothing changes but the time.
    """
    if device.type != "cuda":
        return False  # the CPU inductor compiles C++ in the process: no Triton pool
    root = resolve_root()
    if root is not None:
        set_cache_env(CacheDir(root, cache_key(device)))
    try:
        from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
    except ImportError:
        return False
    maybe_warm_pool()
    AsyncCompile.use_process_pool()  # sends the readiness probe: kernels go to the pool once it answers
    return True


def start(device: torch.device, echo: Callable[[str], None] = print) -> CounterReporter:
    """A training process's hook before its first compile: activate ``$FLEET_COMPILE_CACHE``'s
    key dir for ``device`` (blob loaded when warmed; nothing when unset) and return the
    ``compile_cache`` reporter to call after every step."""
    root = resolve_root()
    if root is None:
        return CounterReporter("")
    active = activate(root, device)
    echo(active.line())
    return CounterReporter(active.cache.key.text)


def cache_counters() -> dict[str, int]:
    """This process's cache hits and misses so far, under the ``compile_cache`` event's names."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][counter]) for name, (group, counter) in COUNTERS.items()}


class EventSink(Protocol):
    def emit(self, event: str, **fields: Any) -> dict[str, Any]: ...


class CounterReporter:
    """Emits ``compile_cache`` at its first call and whenever the counters changed since."""

    def __init__(self, key: str = "") -> None:
        self.key = key
        self._last: dict[str, int] | None = None

    def report(self, events: EventSink, **extra: Any) -> dict[str, int] | None:
        """Emit when due; returns the counters emitted (None when nothing changed)."""
        now = cache_counters()
        if now == self._last:
            return None
        self._last = now
        events.emit("compile_cache", **now, key=self.key, **extra)
        return now


def format_counters(counts: Mapping[str, int]) -> str:
    return (
        f"fxgraph {counts.get('fxgraph_hit', 0)} hit / {counts.get('fxgraph_miss', 0)} miss, "
        f"aotautograd {counts.get('aotautograd_hit', 0)} hit / {counts.get('aotautograd_miss', 0)} miss"
    )


__all__ = [
    "AUTOTUNE_FILE",
    "BLOB_FILE",
    "MANIFEST_FILE",
    "ROOT_ENV",
    "ActiveCache",
    "CacheDir",
    "CacheKey",
    "CounterReporter",
    "Manifest",
    "ShapeRecord",
    "activate",
    "cache_counters",
    "cache_key",
    "env_lock_hash",
    "load_blob",
    "pack_autotune",
    "resolve_root",
    "save_blob",
    "start",
    "start_workers",
    "unpack_autotune",
]
