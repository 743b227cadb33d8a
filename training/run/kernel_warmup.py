"""The hybrid target's kernel warm-up in a process of its own, beside the drafter's compile.

A hybrid target's linear-attention kernels (flash-linear-attention's Triton kernels) compile and
autotune at their first call, one after another in the calling process (~48 s for the 27B shape
on an H200); the drafter's compile is mostly CPU work in inductor (and its worker pool). Run one
after the other they add up; here the target's half runs in a spawned process that starts with
the warm-up, imports torch and builds its cut of the target while the parent loads the data, then
runs one forward per shape as soon as the parent sends the shapes. Both write into the same key's
``triton/`` dir (inherited through the environment that ``activate`` set before the spawn).

A process, not a thread: torch.compile and Triton's JIT in threads of one process is the race that
cost the field days. A plain ``python -m training.run.kernel_warmup`` child (no multiprocessing
helpers left behind): its stdin brings the pickled (config, target config, device, dtype), then the
shapes; its stdout carries JSON lines: ``{"line": ...}`` progress, then ``{"done": fast_path,
"shapes": [...]}`` or ``{"error": kind, "text": ...}`` (anything else the libraries print goes to
its stderr, the parent's). A ``ConfigError`` in the child (``target.require_fast_path`` on the
torch fallback) is a ``ConfigError`` in the parent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from training.compile.cache import ShapeRecord
from training.config import ConfigError, RunConfig

Echo = Callable[[str], None]


class KernelWarmupFailed(RuntimeError):
    """The kernel warm-up's process failed or died; ``str()`` is one line."""


def _send(out: IO[bytes], message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def child_main() -> int:
    """The child: build the probe, wait for the shapes, warm, report on the original stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the libraries print goes to stderr, not into the messages
    try:
        from training.run.warm import kernel_probe_target, warm_target_kernels

        config, hf_config, device, dtype = pickle.load(sys.stdin.buffer)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)
        probe = kernel_probe_target(hf_config, dev, getattr(torch, dtype))
        shapes = pickle.load(sys.stdin.buffer)
        fast_path, done = (
            ("n/a", [])
            if probe is None
            else warm_target_kernels(
                config, probe, shapes, device=dev, echo=lambda line: _send(out, {"line": line})
            )
        )
        _send(out, {"done": fast_path, "shapes": [dataclasses.astuple(s) for s in done]})
    except ConfigError as exc:
        _send(out, {"error": "config", "text": str(exc)})
    except BaseException as exc:  # one line to the parent; the child exits either way
        first = next((s.strip() for s in str(exc).splitlines() if s.strip()), "")
        _send(
            out, {"error": "other", "text": f"{type(exc).__name__}: {first}" if first else type(exc).__name__}
        )
    return 0


class KernelWarmup:
    """The running child: ``send_shapes`` once the data plan is known, ``result`` to wait for it."""

    def __init__(self, config: RunConfig, hf_config: Any, device: torch.device, dtype: torch.dtype) -> None:
        here = str(Path(__file__).resolve().parents[2])  # the dir holding ``training/``
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "training.run.kernel_warmup"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        header = (config, hf_config, str(device), str(dtype).removeprefix("torch."))
        self._write(pickle.dumps(header))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is gone: ``result`` says why

    def send_shapes(self, shapes: Sequence[ShapeRecord]) -> None:
        self._write(pickle.dumps(list(shapes)))

    def result(self, echo: Echo) -> tuple[str, list[ShapeRecord]]:
        """Wait for the child, echoing its lines: (fast path, shapes done)."""
        assert self._proc.stdout is not None
        try:
            for raw in self._proc.stdout:
                message = json.loads(raw)
                if "line" in message:
                    echo(message["line"])
                elif "done" in message:
                    return message["done"], [ShapeRecord(*fields) for fields in message["shapes"]]
                elif message["error"] == "config":
                    raise ConfigError(message["text"])
                else:
                    raise KernelWarmupFailed(f"warm: the target's kernel warm-up failed: {message['text']}")
            code = self._proc.wait()
            raise KernelWarmupFailed(
                f"warm: the target's kernel warm-up process ended without a result (exit code {code}; "
                "killed for memory?)"
            )
        finally:
            self.close()

    def close(self) -> None:
        """Stop the child if it still runs (the parent failed first) and release its pipes."""
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


__all__ = ["KernelWarmup", "KernelWarmupFailed", "child_main"]

if __name__ == "__main__":
    sys.exit(child_main())
