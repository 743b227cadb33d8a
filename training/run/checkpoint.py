"""Checkpoints: one manager for cadence, background writes, verification, resume and pruning.

A checkpoint is one file ``<run-dir>/checkpoints/step-00000123.pt`` holding everything a
resumed run needs to continue exactly where the killed one stopped: the drafter's own
weights (not the shared frozen embedding / lm_head), optimizer and scheduler state, the data
position of the next batch, the RNG states and the step. It is written to a temp file in the
same folder and fsync'd; then its size and sha256, read back from the file, go into its manifest
``step-00000123.pt.manifest.json`` (written and fsync'd the same way and renamed into place
first), then the checkpoint is renamed into place and the folder fsync'd: a ``kill -9`` at any
moment leaves either the previous checkpoints or the new one with its manifest, never a torn file
under the final name.

Verification (``verify``): a checkpoint is used only when its size and sha256 match its manifest
(torch.load does not check the zip's CRCs: a few KB overwritten inside a checkpoint load as
garbage weights). A checkpoint written before manifests existed is checked by every zip record's
CRC-32 (``zipfile.testzip``) and a full (memory-mapped) load. ``check_resumable`` is the one
resume decision, shared by the trainer (single process and drafter 0 of an N+M job) and
``python -m training resume-check`` (which ``fab train`` and multi-host ``fab train`` run on the
target): the config must match the one the checkpoints were saved with, and the newest checkpoint
that passes its check is the one resumed; each newer one that fails is named in one line and, by
the trainer, renamed aside (``step-N.pt.bad``, never deleted) with a ``checkpoint_set_aside``
event.

``CheckpointWriter`` does the write in a background thread, so training does not stop for
it: ``save`` only copies the state to host memory (GPU tensors into pinned buffers kept for the
next save, CPU tensors cloned, the rest deep-copied, the RNG states taken now) and returns; a
thread writes that copy as above. One write at a time: the next ``save`` first waits for the
previous one (that wait counts as blocking). Page-locking the host buffers is the slow part of a
first save (seconds for a 1B-parameter drafter's weights and AdamW moments, against ~1 s for the
copies): ``reserve`` allocates them in the background ahead of it, from the state the first
training step leaves. ``poll`` / ``wait`` hand back the finished
``SavedCheckpoint``s (with ``blocking_s``, the time training stood still, and ``total_s``) and
re-raise a write's error. A process killed mid-write leaves the previous checkpoints and a temp
file (``remove_stale_temps``), as the synchronous path does.

``CheckpointManager`` (torchtitan's ``CheckpointManager`` shape) is what the training loops talk
to: ``check`` (the resume decision, lines and events), ``resume`` (load it), ``step_end`` after
each optimizer step (a non-finite loss or gradient norm stops the run before anything is saved;
the cadence save; the events of finished writes), ``save`` and ``wait``. Pruning keeps the last
``checkpoint.keep`` and never removes the newest checkpoint known to have passed its check.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import random
import threading
import time
import zipfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.config import ConfigError, RunConfig, TrainingError
from training.contract import (
    CHECKPOINT_DIR,
    CHECKPOINT_MANIFEST_SUFFIX,
    CHECKPOINT_RE,
    CHECKPOINT_SET_ASIDE_SUFFIX,
    CONFIG_FILE,
    checkpoint_name,
)
from training.data.buckets import Position
from training.events import EventWriter

Echo = Callable[[str], None]


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    path: Path
    seconds: float  # from the save's start until the file is in place (= total_s)
    blocking_s: float | None = None  # of which training stood still (None: all of it, a synchronous save)

    @property
    def total_s(self) -> float:
        return self.seconds


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / checkpoint_name(step)


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + CHECKPOINT_MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Rejected:
    """A checkpoint that failed its check: why, and where it was moved (None: left in place)."""

    step: int
    path: Path
    reason: str
    moved_to: Path | None = None

    def text(self) -> str:
        where = (
            f"set aside as {self.moved_to.name}"
            if self.moved_to is not None
            else f"the trainer sets it aside as {self.path.name}{CHECKPOINT_SET_ASIDE_SUFFIX}"
        )
        return f"checkpoint step {self.step} ({self.path}) failed its check: {self.reason}; {where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "reason": self.reason,
            "moved_to": "" if self.moved_to is None else str(self.moved_to),
        }


@dataclass(frozen=True)
class ResumeDecision:
    """The resume decision for a run dir: the newest checkpoint that passed its check (``path``
    None, ``step`` 0: nothing to resume from) and the newer ones that failed, newest first."""

    step: int
    path: Path | None
    rejected: tuple[Rejected, ...] = ()

    def text(self) -> str:
        lines = [r.text() for r in self.rejected]
        lines.append(f"resume from step {self.step}: {self.path}" if self.path else "no checkpoint to resume")
        return "\n".join(lines)


def check_resumable(
    config: RunConfig, run_dir: Path, *, verify: bool = True, set_aside: bool = False
) -> ResumeDecision:
    """The one resume decision (see the module docstring): the config must be the one the run dir's
    checkpoints were saved with (``ConfigError`` naming the changed keys otherwise: a resume would
    load weights of another shape, or continue another data order silently); then the newest
    checkpoint that passes ``verify_checkpoint``. ``verify=False``: the newest, unchecked (a rank
    that only needs the config check). ``set_aside``: rename each failing one aside (the process
    that resumes; a read-only caller leaves them)."""
    from training.config import resume_mismatches

    found = list_checkpoints(run_dir)
    if not found:
        return ResumeDecision(0, None)
    saved_path = run_dir / CONFIG_FILE
    if saved_path.is_file():
        try:
            saved = json.loads(saved_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{saved_path}: unreadable ({exc}); it belongs to the checkpoints in {run_dir}"
            ) from None
        changed = resume_mismatches(saved, config) if isinstance(saved, dict) else []
        if changed:
            raise ConfigChanged(run_dir, changed)
    if not verify:
        step, path = found[-1]
        return ResumeDecision(step, path.resolve())
    rejected: list[Rejected] = []
    for step, path in reversed(found):
        reason = verify_checkpoint(path, step)
        if not reason:
            return ResumeDecision(step, path.resolve(), tuple(rejected))
        if not path.exists():  # renamed or pruned meanwhile by the process that owns the run dir
            continue
        moved = set_aside_checkpoint(path) if set_aside else None
        rejected.append(Rejected(step, path.resolve() if moved is None else path, reason, moved))
    return ResumeDecision(0, None, tuple(rejected))


class ConfigChanged(ConfigError):
    """The run dir's checkpoints were saved with other model/drafter/data settings."""

    def __init__(self, run_dir: Path, changed: list[str]) -> None:
        self.changed = changed
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        super().__init__(
            f"--run-dir {run_dir} holds checkpoints of another config ({'; '.join(changed[:3])}{more}): "
            "resume with the values it was started with, or give a new --run-dir"
        )


_CHUNK = 8 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in chunks (a checkpoint can be tens of GB)."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def verify_checkpoint(path: Path, step: int) -> str:
    """Why the checkpoint of ``step`` at ``path`` must not be used ("" when it passes): its size and
    sha256 against its manifest; without a manifest (written before manifests existed), every zip
    record's CRC-32 and a memory-mapped load of the whole state."""
    manifest = manifest_path(path)
    if not manifest.exists():
        return _verify_without_manifest(path, step)
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))
        size, sha = int(recorded["bytes"]), str(recorded["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest {manifest.name} is unreadable ({type(exc).__name__}: {exc})"
    try:
        got_size, got_sha = file_digest(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if got_size != size:
        what = "truncated" if got_size < size else "grown"
        return f"{what}: {got_size} bytes, its manifest says {size}"
    if got_sha != sha:
        return "sha256 mismatch: its bytes changed after it was written"
    return ""


def _verify_without_manifest(path: Path, step: int) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        if bad is not None:
            return (
                f"CRC mismatch in {bad} (a checkpoint without a manifest: checked by its zip CRCs and a load)"
            )
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:  # any reader error: the file is not a checkpoint we can use
        first = (str(exc).splitlines() or [""])[0][:200]
        return f"unreadable ({type(exc).__name__}: {first})"
    if not isinstance(state, dict) or state.get("step") != step:
        found = state.get("step") if isinstance(state, dict) else type(state).__name__
        return f"it says step {found}, its name says {step}"
    return ""


def set_aside_checkpoint(path: Path) -> Path:
    """Rename a checkpoint that failed its check (and its manifest) aside, never deleting it:
    ``step-N.pt.bad`` (``.bad.2``, ... when that exists); returns the new path."""
    target = path.with_name(path.name + CHECKPOINT_SET_ASIDE_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CHECKPOINT_SET_ASIDE_SUFFIX}.{n}")
    manifest = manifest_path(path)
    os.replace(path, target)
    if manifest.exists():
        os.replace(manifest, manifest_path(target))
    _fsync_dir(path.parent)
    return target


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temp files are not listed)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = CHECKPOINT_RE.fullmatch(path.name)
        if match:
            found.append((int(match[1]), path))
    return sorted(found)


LEARNED_MASK = "mask_embedding"  # what checkpoints of the learned-MASK drafter held


def drafter_weights(state: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """The drafter's weights of a checkpoint state; an old learned-MASK checkpoint is refused."""
    weights = state["drafter"]
    if LEARNED_MASK in weights:
        raise ConfigError(
            f"{where} holds a learned MASK vector (drafter from before MASK became a token id): "
            "it cannot be resumed or exported; train a new run"
        )
    return weights


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    # RNG states are CPU byte tensors even when the checkpoint was mapped to a GPU.
    torch.random.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _write_file(run_dir: Path, step: int, payload: dict[str, Any]) -> Path:
    """The atomic write of a complete checkpoint payload and its manifest (module docstring)."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    manifest_tmp = folder / f".{manifest_path(final).name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        size, sha = file_digest(tmp)  # what is on disk, not what was handed to write()
        _write_json(manifest_tmp, {"step": step, "file": final.name, "bytes": size, "sha256": sha})
    except OSError:
        # a checkpoint that did not fit must not keep the disk full
        tmp.unlink(missing_ok=True)
        manifest_tmp.unlink(missing_ok=True)
        raise
    # The manifest first: a checkpoint under its final name always has its own manifest.
    os.replace(manifest_tmp, manifest_path(final))
    os.replace(tmp, final)
    _fsync_dir(folder)
    return final.resolve()


def prune(run_dir: Path, keep: int, known_good: Collection[int] = ()) -> list[int]:
    """Remove all but the last ``keep`` checkpoints (with their manifests), never the newest of
    ``known_good`` (steps that passed a check in this process); returns the steps removed."""
    found = list_checkpoints(run_dir)
    kept, dropped = found[-keep:] if keep > 0 else [], found[:-keep] if keep > 0 else found
    if not any(step in known_good for step, _ in kept):
        good = [step for step, _ in dropped if step in known_good]
        dropped = [(step, path) for step, path in dropped if not good or step != good[-1]]
    for _, path in dropped:
        manifest_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    return [step for step, _ in dropped]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> SavedCheckpoint:
    """Write ``state`` as the checkpoint of ``step`` atomically; then keep only the last ``keep``."""
    started = time.monotonic()
    path = _write_file(run_dir, step, {**state, "step": step, "rng": rng_state()})
    prune(run_dir, keep, (step,))
    return SavedCheckpoint(step=step, path=path, seconds=time.monotonic() - started)


class CheckpointWriter:
    """Checkpoints of one run dir written in a background thread (see the module docstring)."""

    def __init__(self, run_dir: Path, keep: int, known_good: set[int] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        # steps that passed a check in this process (written here, or verified at resume): pruning
        # never removes the newest of them
        self.known_good: set[int] = set() if known_good is None else known_good
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}  # pinned host copies, reused
        self._thread: threading.Thread | None = None
        self._done: list[SavedCheckpoint] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._reserved = False

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Snapshot ``state`` (plus the step and the RNG states) and start writing it; returns
        the seconds this call blocked. The caller may change its tensors as soon as it returns."""
        started = time.monotonic()
        self._join()  # its buffers are about to be reused
        self._raise()
        devices: set[torch.device] = set()
        payload = self._walk(
            {**state, "step": step, "rng": rng_state()}, (), lambda t, key: self._copy(t, key, devices)
        )
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies into pinned memory are done
        blocking = time.monotonic() - started
        self._thread = threading.Thread(
            target=self._write, args=(step, payload, started, blocking), name=f"checkpoint-{step}"
        )
        self._thread.start()
        return blocking

    def reserve(self, state: dict[str, Any]) -> None:
        """Allocate in a background thread the pinned buffers a ``save`` of ``state`` (same
        structure and shapes) copies into; the next ``save`` first waits for it. Once: a no-op
        after an earlier ``reserve`` or ``save`` (``reserved``)."""
        if self.reserved:
            return
        self._reserved = True
        specs: list[tuple[tuple[Any, ...], torch.Size, torch.dtype]] = []

        def note(tensor: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor:
            if tensor.device.type == "cuda":
                specs.append((key, tensor.shape, tensor.dtype))
            return tensor

        self._walk(state, (), note)
        self._thread = threading.Thread(target=self._allocate, args=(specs,), name="checkpoint-reserve")
        self._thread.start()

    @property
    def reserved(self) -> bool:
        """Whether buffers exist or are being allocated (``reserve`` has nothing left to do)."""
        return self._reserved or bool(self._buffers)

    def _allocate(self, specs: list[tuple[tuple[Any, ...], torch.Size, torch.dtype]]) -> None:
        try:
            for key, shape, dtype in specs:
                self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=True)
        except BaseException as exc:  # handed to the training thread by the next save / poll
            with self._lock:
                self._error = exc

    def poll(self) -> list[SavedCheckpoint]:
        """The saves finished since the last call (oldest first); a failed write raises here."""
        self._raise()
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self) -> list[SavedCheckpoint]:
        """Wait for the write in flight, then ``poll``."""
        self._join()
        return self.poll()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, step: int, payload: dict[str, Any], started: float, blocking: float) -> None:
        try:
            path = _write_file(self.run_dir, step, payload)
            self.known_good.add(step)
            prune(self.run_dir, self.keep, self.known_good)
        except BaseException as exc:  # handed to the training thread by poll / wait / save
            with self._lock:
                self._error = exc
            return
        saved = SavedCheckpoint(step, path, time.monotonic() - started, blocking)
        with self._lock:
            self._done.append(saved)

    def _walk(self, obj: Any, key: tuple[Any, ...], on_tensor: Any) -> Any:
        """A copy of ``obj`` with every tensor replaced by ``on_tensor(tensor, key)``; ``key``:
        the tensor's path in the structure (the pinned buffer it reuses)."""
        if isinstance(obj, torch.Tensor):
            return on_tensor(obj.detach(), key)
        if isinstance(obj, dict):
            out = type(obj)((k, self._walk(v, (*key, k), on_tensor)) for k, v in obj.items())
            if hasattr(obj, "_metadata"):  # a module state_dict's version info (load_state_dict reads it)
                out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list | tuple) and type(obj) in (list, tuple):
            return type(obj)(self._walk(v, (*key, i), on_tensor) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy(self, tensor: torch.Tensor, key: tuple[Any, ...], devices: set[torch.device]) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor.clone()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=True)
        devices.add(tensor.device)
        return buffer


def remove_stale_temps(run_dir: Path) -> int:
    """Delete temp files left by a process killed while writing, and a manifest whose checkpoint
    never got its name (killed between the two renames); returns how many."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return 0
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    stale += [
        p
        for p in folder.iterdir()
        if p.name.endswith(CHECKPOINT_MANIFEST_SUFFIX)
        and CHECKPOINT_RE.fullmatch(p.name.removesuffix(CHECKPOINT_MANIFEST_SUFFIX))
        and not p.with_name(p.name.removesuffix(CHECKPOINT_MANIFEST_SUFFIX)).exists()
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def load_checkpoint(path: Path, step: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state of the checkpoint of ``step`` at ``path`` (with ``path`` added)."""
    # weights_only=False: the state holds Python/numpy RNG states; the file is our own.
    state = torch.load(path, map_location=map_location, weights_only=False)
    state["path"] = str(path.resolve())
    if state.get("step") != step:
        raise ValueError(f"checkpoint {path} says step {state.get('step')}, its name says {step}")
    return state


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest checkpoint's state (with ``step`` and ``path``), or None when there is none
    (unchecked: the trainer resumes through ``CheckpointManager``)."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return None
    step, path = checkpoints[-1]
    return load_checkpoint(path, step, map_location)


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states stored in a checkpoint."""
    if "rng" in state:
        set_rng_state(state["rng"])


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run continues: the checkpoint's step, next data position and last tau."""

    step: int
    position: Position
    tau: float
    path: str


def load_into(
    path: Path,
    step: int,
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    map_location: str | torch.device,
) -> Resumed:
    """Load a checkpoint into drafter, optimizer and scheduler and restore its RNG states."""
    state = load_checkpoint(path, step, map_location)
    drafter.load_state_dict(drafter_weights(state, state["path"]))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    resumed = Resumed(
        int(state["step"]), Position(*state["position"]), float(state.get("tau", 1.0)), state["path"]
    )
    restore_rng(state)
    return resumed


class NonFiniteLoss(TrainingError):
    """A step's loss or gradient norm was NaN or infinite: the run stops before it checkpoints the
    step (its weights are garbage from here on). Not retried: a resume would replay the same batch."""

    exit_code = 4


def check_finite(step: int, loss: float, grad_norm: float, last_saved: int) -> None:
    """``NonFiniteLoss`` naming the step when ``loss`` or ``grad_norm`` is not finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    kept = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
    raise NonFiniteLoss(
        f"non-finite {what} at step {step} (loss {loss}, gradient norm {grad_norm}): stopped before "
        f"checkpointing it, {kept}; lower train.lr or raise train.warmup_steps / lower train.grad_clip, "
        "or check the data of that step, then train again"
    )


class CheckpointManager:
    """The checkpoints of one training process (module docstring). ``writes``: this process writes
    them (one per run dir: the single trainer, drafter 0 of an N+M job); others only resume.
    ``state``: what a checkpoint holds now (``core.checkpoint_state``)."""

    def __init__(
        self,
        run_dir: Path,
        config: RunConfig,
        state: Callable[[], dict[str, Any]],
        *,
        events: EventWriter | None,
        echo: Echo,
        writes: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.state = state
        self.events = events
        self.echo = echo
        self.writes = writes
        self.every = config.checkpoint.every
        self.total_steps = config.train.steps
        self.known_good: set[int] = set()
        self.writer = CheckpointWriter(self.run_dir, config.checkpoint.keep, self.known_good)
        self.point = ResumeDecision(0, None)
        self.last_saved = 0

    # ------------------------------------------------------------ resume
    def check(self, *, verify: bool | None = None) -> ResumeDecision:
        """The resume decision (``check_resumable``; a writer sets failing checkpoints aside, one
        line each; their events follow in ``resume``). ``verify`` defaults to ``writes``."""
        verify = self.writes if verify is None else verify
        self.point = check_resumable(
            self.config, self.run_dir, verify=verify, set_aside=verify and self.writes
        )
        for rejected in self.point.rejected:
            self.echo(rejected.text())
        if self.point.path is not None and verify:
            self.known_good.add(self.point.step)
        return self.point

    def resume(
        self,
        drafter: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        map_location: str | torch.device,
        step: int | None = None,
    ) -> Resumed | None:
        """Load the checked checkpoint (``step``: that one instead, e.g. the step the writer rank
        chose) into drafter, optimizer and scheduler; None when there is none. A writer first
        removes the temp files a killed writer left and emits a ``checkpoint_set_aside`` event per
        checkpoint ``check`` set aside (here: after the launch's ``run_start``)."""
        if self.writes:
            remove_stale_temps(self.run_dir)
            for rejected in self.point.rejected:
                if self.events is not None and rejected.moved_to is not None:
                    self.events.emit("checkpoint_set_aside", **rejected.to_json())
        if step is None:
            step, path = self.point.step, self.point.path
        else:
            path = checkpoint_path(self.run_dir, step) if step else None
        if not step or path is None or not path.exists():
            return None
        resumed = load_into(path, step, drafter, optimizer, scheduler, map_location)
        self.last_saved = resumed.step
        return resumed

    # ------------------------------------------------------------ training
    def step_end(self, step: int, loss: float, grad_norm: float) -> None:
        """After optimizer step ``step``: stop on a non-finite loss before anything is saved; on the
        first step reserve the snapshot buffers; report finished writes; save on the cadence
        (``checkpoint.every``; the last step is saved by ``save`` when the loop ends)."""
        check_finite(step, loss, grad_norm, self.last_saved)
        if not self.writes:
            return
        if not self.writer.reserved:  # the first step made the optimizer's state
            self.writer.reserve(self.state())
        self.report()
        if self.every and step % self.every == 0 and step < self.total_steps:
            self.save(step)
            if self.events is not None:
                self.events.phase("train")

    def save(self, step: int) -> None:
        """``phase: checkpoint`` and a background save of ``step`` unless it is saved already."""
        if not self.writes or step == self.last_saved:
            return
        if self.events is not None:
            self.events.phase("checkpoint")
        self.writer.save(step, self.state())
        self.last_saved = step

    def report(self, *, wait: bool = False) -> None:
        """The ``checkpoint`` event of each write finished since the last call (``wait``: first wait
        for the one in flight); a failed write raises here, in the training thread."""
        for saved in self.writer.wait() if wait else self.writer.poll():
            blocking = saved.total_s if saved.blocking_s is None else saved.blocking_s
            if self.events is not None:
                self.events.emit(
                    "checkpoint",
                    step=saved.step,
                    path=str(saved.path),
                    seconds=saved.total_s,
                    blocking_s=blocking,
                    total_s=saved.total_s,
                )
            self.echo(
                f"checkpoint step {saved.step} -> {saved.path} ({saved.total_s:.2f}s, "
                f"training blocked {blocking:.2f}s)"
            )

    def wait(self) -> None:
        """Wait for the write in flight and report it."""
        self.report(wait=True)

    def close(self) -> None:
        """A write in flight completes even when training failed (its error is not raised: on an
        error path the training error is the one to report)."""
        with contextlib.suppress(Exception):
            self.writer.wait()
