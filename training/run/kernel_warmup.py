"""The hybrid target's kernel warm-up in a process of its own, beside the drafter's compile.

Here too: the target cut to its first layers up to one of each kind (``cut_target``) and one forward
per shape (``run_target_shapes``), which ``training.run.warm`` also uses for a dense target's
compiled forward.

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
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from training.compile.cache import ShapeRecord, cache_counters, format_counters
from training.config import ConfigError, RunConfig

Echo = Callable[[str], None]


def print_line(line: str) -> None:
    print(line, flush=True)


def kernel_probe_target(hf_config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module | None:
    """The target cut to one layer of each kind (random weights, on ``device``) for warming its
    linear-attention kernels; None when it has no linear-attention layers."""
    return cut_target(hf_config, device, dtype) if has_linear_attention(hf_config) else None


def has_linear_attention(hf_config: Any) -> bool:
    """Whether the target has linear-attention layers (Triton kernels of its own to warm)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return "linear_attention" in list(getattr(text, "layer_types", None) or [])


def cut_target(hf_config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target cut to its first layers up to one of each kind (one layer for a dense target),
    random weights, on ``device``, frozen: the layer shapes, dtype and code of the real target, so
    what it compiles or autotunes per batch shape is what the real target's forward uses."""
    from transformers import AutoModelForCausalLM

    text = getattr(hf_config, "text_config", None) or hf_config
    types = list(getattr(text, "layer_types", None) or [])
    depth = next((n for n in range(1, len(types) + 1) if set(types[:n]) == set(types)), 1)
    cut_fields: dict[str, Any] = {"num_hidden_layers": depth}
    if types:
        cut_fields["layer_types"] = types[:depth]
    cut = type(text).from_dict({**text.to_dict(), **cut_fields})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cut, dtype=dtype)
    model = model.to_empty(device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model.init_weights()
    return model.eval().requires_grad_(False)


def warm_target_kernels(
    config: RunConfig,
    probe: nn.Module,
    shapes: Sequence[ShapeRecord],
    *,
    device: torch.device,
    echo: Echo = print_line,
) -> tuple[str, list[ShapeRecord]]:
    """One forward of ``probe`` per shape when its delta rule runs a kernel: (fast path, shapes done).
    With ``target.require_fast_path`` a GPU warm-up on the torch fallback stops here (one line),
    as the run would."""
    from training.model.kernels import linear_attention_kernels, require_fast_path

    kernels = linear_attention_kernels(probe)
    echo(f"warm: {kernels.line()}")
    require_fast_path(kernels, device_type=device.type, required=config.target.require_fast_path, who="warm")
    if kernels.fast_path != "yes":
        echo("warm: the target's linear attention runs on the torch fallback: no kernels to warm")
        return kernels.fast_path, []
    return kernels.fast_path, run_target_shapes(probe, shapes, device=device, echo=echo)


def run_target_shapes(
    probe: nn.Module,
    shapes: Sequence[ShapeRecord],
    *,
    device: torch.device,
    echo: Echo = print_line,
    what: str = "",
) -> list[ShapeRecord]:
    """One target forward (the trainer's ``target_forward``, every layer) per shape, random tokens;
    the shapes with their seconds. ``what`` names the warm-up in the progress lines (default: the
    linear-attention kernels)."""
    from training.model.target import num_layers, target_forward

    vocab = probe.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    every_layer = list(range(num_layers(probe)))  # the deepest is the last: no early stop
    done = []
    for i, shape in enumerate(shapes, 1):
        started = time.monotonic()
        ids = torch.randint(0, vocab, (shape.batch_size, shape.length), generator=generator).to(device)
        target_forward(probe, ids, every_layer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.monotonic() - started
        done.append(ShapeRecord(shape.bucket, shape.batch_size, shape.length, round(seconds, 3)))
        note = (
            f"{what}, {format_counters(cache_counters())}"
            if what
            else "the linear-attention kernels compile and autotune at their first use"
        )
        where = f"[{i}/{len(shapes)}] batch {shape.batch_size} x {shape.length}"
        echo(f"warm target {where}: {seconds:.1f}s ({note})")
    return done


_COMPILER_ERROR = re.compile(r"(?:^|[\s:])(?:fatal )?error\b", re.IGNORECASE)


def error_summary(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``, plus the first line of its message that reads like a
    compiler error (``file:line:col: error: ...``) when that is not the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    detail = next((line for line in lines[1:] if _COMPILER_ERROR.search(line)), "")
    return f"{head}; compiler: {detail}" if detail else head


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
        _send(out, {"error": "other", "text": error_summary(exc)})
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
        except OSError:
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

    def __enter__(self) -> KernelWarmup:
        return self

    def __exit__(self, *exc: object) -> None:
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


__all__ = [
    "Echo",
    "KernelWarmup",
    "KernelWarmupFailed",
    "child_main",
    "cut_target",
    "error_summary",
    "has_linear_attention",
    "kernel_probe_target",
    "print_line",
    "run_target_shapes",
    "warm_target_kernels",
]

if __name__ == "__main__":
    sys.exit(child_main())
