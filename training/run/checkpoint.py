"""Checkpoints: written atomically, the last K kept, the newest complete one found on resume.

A checkpoint is one file ``<run-dir>/checkpoints/step-00000123.pt`` holding everything a
resumed run needs to continue exactly where the killed one stopped: the drafter's own
weights (not the shared frozen embedding / lm_head), optimizer and scheduler state, the data
position of the next batch, the RNG states and the step. It is written to a temp file in the
same folder, fsync'd, renamed into place and the folder fsync'd: a ``kill -9`` at any moment
leaves either the previous checkpoints or the new one, never a torn file under the final name.

``CheckpointWriter`` does the same write in a background thread, so training does not stop for
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
"""

from __future__ import annotations

import copy
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import ConfigError
from training.contract import CHECKPOINT_DIR, CHECKPOINT_RE, CONFIG_FILE, checkpoint_name


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


def check_resumable(config: Any, run_dir: Path) -> None:
    """Before a run writes its config into ``run_dir``: when the dir holds checkpoints, the model,
    drafter and data settings must be those they were saved with (``ConfigError`` naming the
    changed keys otherwise: a resume would load weights of another shape, or continue another
    data order silently)."""
    from training.config import ConfigError, resume_mismatches

    saved_path = run_dir / CONFIG_FILE
    if not list_checkpoints(run_dir) or not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{saved_path}: unreadable ({exc}); it belongs to the checkpoints in {run_dir}"
        ) from None
    changed = resume_mismatches(saved, config)
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ConfigError(
            f"--run-dir {run_dir} holds checkpoints of another config ({'; '.join(changed[:3])}{more}): "
            "resume with the values it was started with, or give a new --run-dir"
        )


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


def _write_file(run_dir: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """The atomic write of a complete checkpoint payload (tmp, fsync, rename, fsync the folder);
    then keep only the last ``keep``."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a checkpoint that did not fit must not keep the disk full
        raise
    os.replace(tmp, final)
    _fsync_dir(folder)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final.resolve()


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> SavedCheckpoint:
    """Write ``state`` as the checkpoint of ``step`` atomically; then keep only the last ``keep``."""
    started = time.monotonic()
    path = _write_file(run_dir, step, {**state, "step": step, "rng": rng_state()}, keep)
    return SavedCheckpoint(step=step, path=path, seconds=time.monotonic() - started)


class CheckpointWriter:
    """Checkpoints of one run dir written in a background thread (see the module docstring)."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
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
            path = _write_file(self.run_dir, step, payload, self.keep)
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
    """Delete temp files left by a process killed while writing; returns how many."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return 0
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest checkpoint's state (with ``step`` and ``path``), or None when there is none."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return None
    step, path = checkpoints[-1]
    # weights_only=False: the state holds Python/numpy RNG states; the file is our own.
    state = torch.load(path, map_location=map_location, weights_only=False)
    state["path"] = str(path.resolve())
    if state.get("step") != step:
        raise ValueError(f"checkpoint {path} says step {state.get('step')}, its name says {step}")
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states stored in a checkpoint."""
    if "rng" in state:
        set_rng_state(state["rng"])
