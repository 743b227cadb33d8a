"""Known failure signatures of a training run -> a cause and a fix (pure: text in, data out).

``diagnose(log_text, events)`` scans the raw log tail (and the ``error`` events of
``events.jsonl``) for the failures seen on multi-GPU DFlash runs: the FX-tracing
RuntimeError from compiling in threads, Dynamo's recompile limit (silent dense fallback),
flex_attention without ``torch.compile``, CUDA OOM, NCCL timeouts and dead ranks, an NVML
driver/library mismatch, import errors (environment drift), a full disk, a non-finite loss (the
trainer stopped before checkpointing it), a torchrun rendezvous
that did not come up, a C++ abort
(``terminate called after throwing ...``) or native crash, and any other Python traceback;
``killed_diagnosis`` names the likely causes of a SIGKILL (exit 137).
Each signature is reported once, at its first occurrence, in the order found in the log (the
first failure is usually the root cause). The generic "Python traceback" diagnosis is only
given when no specific signature matched.

The log may be a ``tail -c`` cut: partial first line, ``\\r`` progress bars, NUL
bytes, and torchrun's ``[rankN]:`` / ``[defaultN]:`` prefixes from interleaved ranks
are all tolerated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.contract import CHECKPOINT_DIR
from training.contract import RANK_PREFIX as _RANK_PREFIX
from training.contract import log_lines as clean_lines  # NULs, \r and rank prefixes handled


@dataclass(frozen=True)
class Diagnosis:
    """One recognised failure: what happened, what to do, and the log line that shows it."""

    signature: str  # stable id, e.g. "cuda-oom"
    cause: str
    fix: str
    evidence: str

    def to_json(self) -> dict[str, str]:
        return {
            "signature": self.signature,
            "cause": self.cause,
            "fix": self.fix,
            "evidence": self.evidence,
        }


_MAX_EVIDENCE = 240


def _short(line: str) -> str:
    line = line.strip()
    return line if len(line) <= _MAX_EVIDENCE else line[: _MAX_EVIDENCE - 3] + "..."


# A matcher gets the lines and the index of a line matching its trigger; it returns the diagnosis.
Matcher = Callable[[list[str], int, re.Match[str]], Diagnosis]


def _fx_trace(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    return Diagnosis(
        "fx-trace-threads",
        "torch.compile'd code was called while another thread was FX-tracing (concurrent "
        "compilation in threads: the 'FX is tracing' flag is process-global before torch 2.14)",
        "run one process per GPU (fleet's torchrun topology), or serially pre-warm every "
        "(GPU, bucket) forward+backward before threads start and then set_stance('fail_on_recompile') "
        "— `fab warm`",
        _short(lines[i]),
    )


def _recompile_limit(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    limit = m.group(2)
    return Diagnosis(
        "recompile-limit",
        f"Dynamo hit config.{m.group(1)} ({limit}): the function now runs uncompiled — for "
        "flex_attention that is the dense path, which materializes the full score matrix (-> OOM)",
        f"set torch._dynamo.config.{m.group(1)} above GPUs x length buckets and "
        "torch._dynamo.config.fail_on_recompile_limit_hit = True so it fails loudly",
        _short(lines[i]),
    )


def _flex_dense(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    return Diagnosis(
        "flex-uncompiled",
        "flex_attention ran without torch.compile(): the unfused path materializes the full "
        "score matrix (hundreds of GiB at long context)",
        "keep flex_attention compiled (torch.compile(flex_attention)); fix compile errors instead "
        "of disabling compile; warm the cache with `fab warm`",
        _short(lines[i]),
    )


_SIZE = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]i?B)")
_GPU = re.compile(r"GPU (\d+) has a total capacity of ([\d.]+ ?[KMGT]i?B)")


def _cuda_oom(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    line = lines[i]
    size = _SIZE.search(line)
    gpu = _GPU.search(line)
    what = f"tried to allocate {size.group(1)}" if size else "allocation failed"
    where = f" on GPU {gpu.group(1)} (capacity {gpu.group(2)})" if gpu else ""
    huge = bool(size) and _gib(size.group(1)) > 64
    cause = f"CUDA out of memory: {what}{where}"
    if huge:
        cause += " — a size like this is a dense attention/score matrix, not a tuning problem"
        fix = (
            "make sure flex_attention is compiled (look for a recompile-limit or 'called without "
            "torch.compile()' line above); do not disable compile"
        )
    else:
        fix = (
            "lower the batch/bucket token budget or chunk size, or set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; check the GPU was empty at start"
        )
    return Diagnosis("cuda-oom", cause, fix, _short(line))


def _gib(size: str) -> float:
    m = re.match(r"([\d.]+) ?([KMGT])", size)
    if not m:
        return 0.0
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}[m.group(2)]
    return float(m.group(1)) * scale


def _nccl_timeout(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    op = re.search(r"OpType=(\w+)", lines[i])
    ran = re.search(r"ran for (\d+) milliseconds", lines[i])
    detail = ""
    if op:
        detail += f" ({op.group(1)}"
        detail += f", {int(ran.group(1)) / 1000:.0f} s)" if ran else ")"
    return Diagnosis(
        "nccl-timeout",
        f"an NCCL collective timed out{detail}: a peer rank stopped participating (died, hung, "
        "or is far slower)",
        "look for the first rank that failed (its traceback or exit code) and fix that; if ranks are "
        "merely slow, rebalance the topology or raise the process-group timeout",
        _short(lines[i]),
    )


def _rank_died(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    block = "\n".join(lines[i : i + 30])
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    signal = re.search(r"Signal (\d+) \((\w+)\)", block)
    who = f"rank {rank.group(1)}" if rank else "a rank"
    how = f" with exit code {code.group(1)}" if code else ""
    if signal:
        how += f" ({signal.group(2)})"
    fix = "read that rank's own traceback above"
    if signal and signal.group(2) == "SIGKILL":
        fix = (
            "SIGKILL is usually the kernel OOM killer (host RAM) or a manual kill: check `dmesg`, host memory"
        )
    return Diagnosis(
        "rank-died",
        f"torchrun: {who} died{how}; the other ranks were stopped",
        fix,
        _short(lines[i]),
    )


def _nvml(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    return Diagnosis(
        "nvml-mismatch",
        "NVIDIA driver/library version mismatch: the kernel driver and the user-space NVML/CUDA "
        "libraries differ (driver upgraded without a reboot, or mismatched libs in the container)",
        "reboot the host (or reload the nvidia modules) so the driver matches; in an LXC container "
        "the user-space driver libraries must be the host driver's version",
        _short(lines[i]),
    )


def _import(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    return Diagnosis(
        "import-error",
        f"{m.group(1)}: {m.group(2).strip()} — the environment is not what the release expects (env drift)",
        "run `fab env-check` to see what drifted, then rebuild the env from its lock",
        _short(lines[i]),
    )


_QUOTED_PATH = re.compile(r"""['"](/[^'"]+)['"]""")


def _disk_full(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    path = _QUOTED_PATH.search(lines[i])
    where = f" while writing {path.group(1)}" if path else ""
    return Diagnosis(
        "disk-full",
        f"the disk is full (No space left on device){where}",
        f"free space on the target (`df -h` there): old runs' checkpoints (runs/*/{CHECKPOINT_DIR}), unused "
        "envs (`fab env-rebuild --gc`), the compile cache; keep fewer checkpoints (checkpoint.keep); "
        "then `fab train` resumes from the last complete checkpoint",
        _short(lines[i]),
    )


def _cpp_abort(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    what = next((line.strip() for line in lines[i + 1 : i + 4] if line.strip().startswith("what():")), "")
    detail = f": {what[len('what():') :].strip()}" if what else ""
    return Diagnosis(
        "cpp-abort",
        f"the process aborted on an uncaught C++ exception ({m.group(1)}){detail}",
        "a CUDA error here is usually a device fault or a bad kernel: rerun with CUDA_LAUNCH_BLOCKING=1 "
        "to see the failing op, and check `fab gpus` (ECC, Xid) and `fab env-check`",
        _short(what or lines[i]),
    )


def _native_crash(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    return Diagnosis(
        "native-crash",
        f"the process crashed in native code ({m.group(1)})",
        "the Python stack printed after 'Fatal Python error' shows where; a crash in torch/CUDA "
        "libraries often means mismatched builds: `fab env-check`",
        _short(lines[i]),
    )


def _rendezvous(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    """training.launch's one line for a torchrun rendezvous that did not come up."""
    return Diagnosis(
        "rendezvous",
        f"torchrun's ranks did not meet: {m.group(1)}",
        m.group(2).strip(),
        _short(lines[i]),
    )


def _non_finite(lines: list[str], i: int, m: re.Match[str]) -> Diagnosis:
    """training.run.checkpoint.check_finite's line: the run stopped before checkpointing the step."""
    return Diagnosis(
        "non-finite-loss",
        f"non-finite {m.group(1)} at step {m.group(2)}: the run stopped before checkpointing that step; "
        "its earlier checkpoints are kept",
        "lower train.lr, raise train.warmup_steps or lower train.grad_clip (or check that step's data), "
        "then `fab train` resumes from the last good checkpoint; a plain restart replays the same step",
        _short(lines[i]),
    )


@dataclass(frozen=True)
class Signature:
    """One row of the table: the line that triggers it, what it means, and whether a restart can help."""

    id: str  # the Diagnosis.signature its matcher returns
    pattern: re.Pattern[str]
    matcher: Matcher
    # False: running the same command again cannot fix it, so the restart policy does not retry it.
    retryable: bool = True


_SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "fx-trace-threads",
        re.compile(r"Detected that you are using FX to symbolically trace a dynamo-optimized"),
        _fx_trace,
        retryable=False,
    ),
    Signature(
        "recompile-limit",
        re.compile(r"torch\._dynamo hit config\.(recompile_limit|cache_size_limit\w*) \((\d+)\)"),
        _recompile_limit,
    ),
    Signature(
        "flex-uncompiled", re.compile(r"flex_attention called without torch\.compile\(\)"), _flex_dense
    ),
    Signature("cuda-oom", re.compile(r"(?:OutOfMemoryError|RuntimeError): CUDA out of memory"), _cuda_oom),
    Signature("nccl-timeout", re.compile(r"Watchdog caught collective operation timeout"), _nccl_timeout),
    Signature("rank-died", re.compile(r"errors\.ChildFailedError"), _rank_died),
    Signature(
        "nvml-mismatch",
        re.compile(r"Driver/library version mismatch|NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
        _nvml,
        retryable=False,
    ),
    Signature(
        "import-error", re.compile(r"^(ModuleNotFoundError|ImportError): (.+)$"), _import, retryable=False
    ),
    Signature(
        "non-finite-loss",
        re.compile(r"non-finite (loss|gradient norm) at step (\d+)"),
        _non_finite,
        retryable=False,
    ),
    Signature("disk-full", re.compile(r"No space left on device|\[Errno 28\]"), _disk_full),
    Signature(
        "rendezvous",
        re.compile(r"^torchrun: ((?:the rendezvous|cannot reach the rendezvous)\b.*?\)): (.+)$"),
        _rendezvous,
    ),
)
# How a process died when nothing more specific says why (a NCCL watchdog timeout, for one,
# ends in a C++ abort too): used only when no signature above matched, before the bare traceback.
_FALLBACKS: tuple[Signature, ...] = (
    Signature(
        "cpp-abort", re.compile(r"terminate called after throwing an instance of '([^']+)'"), _cpp_abort
    ),
    Signature(
        "native-crash",
        re.compile(r"Fatal Python error: (Segmentation fault|Bus error|Aborted|Floating point exception)"),
        _native_crash,
    ),
)

# The causes the restart policy never retries (fleet/remote/run.sh; exit 2, a config error, is not
# retried either): (signature, pattern) rows of the table above, applied to the failed attempt's
# log by remote/run_cause.py with the same line cleaning as ``diagnose``.
NOT_RETRYABLE: tuple[tuple[str, str], ...] = tuple(
    (sig.id, sig.pattern.pattern) for sig in _SIGNATURES if not sig.retryable
)

# Signatures that mean the process died (not a warning it survived): a log that shows one has
# failed, even when nothing says whether its process still runs (`fab status --log`).
FATAL_SIGNATURES = frozenset(
    {
        "fx-trace-threads",
        "cuda-oom",
        "nccl-timeout",
        "rank-died",
        "import-error",
        "disk-full",
        "non-finite-loss",
        "rendezvous",
        "cpp-abort",
        "native-crash",
        "python-traceback",
    }
)
SIGKILL_EXIT = 137  # 128 + 9: what a shell reports for a process killed by SIGKILL


def resume_words(checkpoint_step: int | None) -> str:
    """What ``fab train`` will find: the newest checkpoint's step, or none (a start from step 1)."""
    if checkpoint_step:
        return f"`fab train` resumes from the checkpoint of step {checkpoint_step}"
    return "`fab train` starts the run again from step 1 (it wrote no checkpoint)"


def killed_diagnosis(
    exit_code: int | None,
    stop_signal: str,
    kernel_readable: bool | None,
    kernel_oom: Sequence[str],
    checkpoint_step: int | None = None,
) -> Diagnosis | None:
    """A run that ended by SIGKILL (exit 137): who killed it, as far as the target can tell;
    ``checkpoint_step``: its newest complete checkpoint (None: none), what a resume finds."""
    if exit_code != SIGKILL_EXIT:
        return None
    resume = resume_words(checkpoint_step)
    if stop_signal == "KILL":
        return Diagnosis(
            "sigkill",
            "killed by `fab stop --force` (SIGKILL, exit 137): no checkpoint was written at the end",
            f"{resume}; plain `fab stop` stops in any phase and checkpoints a trained step before it exits",
            "fab stop --force",
        )
    if kernel_oom:
        return Diagnosis(
            "oom-killer",
            "the kernel's OOM killer killed the run (exit 137): the host or the container ran out of RAM",
            "lower host memory use (data loader workers, pinned buffers, other containers) or raise the "
            "container's memory limit (`pct set <id> --memory <MiB>`)",
            _short(kernel_oom[-1]),
        )
    if kernel_readable:
        check = "the kernel log shows no OOM kill during the run, so most likely one of the others"
    else:
        check = (
            "the kernel log was not readable from here: on the host run "
            "`dmesg -T | grep -i -e oom -e 'killed process'`"
        )
    return Diagnosis(
        "sigkill",
        "the run was killed by SIGKILL (exit 137); the likely causes: the kernel's OOM killer (RAM), "
        "`fab stop --force` or a `kill -9`, or its container being stopped",
        f"{check}; then {resume}",
        f"exit code {SIGKILL_EXIT} (128 + SIGKILL)",
    )


_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# The exception line closing a traceback: a name ending like an exception class, or any
# module-qualified name (torch._dynamo.exc.Unsupported, ...).
_EXC_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Failed)\w*"
    r"|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::|$)"
)


@dataclass(frozen=True)
class Traceback:
    """The last frame and the exception line of one Python traceback in a log."""

    file: str
    line: int
    function: str
    exception: str  # "KeyError: 'completion_ids'"


def last_traceback(lines: Sequence[str]) -> Traceback | None:
    """The last complete traceback in ``lines`` (cleaned), or None."""
    found: Traceback | None = None
    i = 0
    while i < len(lines):
        if lines[i].strip() != _TRACEBACK:
            i += 1
            continue
        frame: tuple[str, int, str] | None = None
        j = i + 1
        while j < len(lines):
            text = lines[j]
            fm = _FRAME.match(text)
            if fm:
                frame = (fm.group(1), int(fm.group(2)), fm.group(3))
            elif text.startswith((" ", "\t")) or not text.strip():
                pass  # source line, caret line, or blank
            else:
                if _EXC_LINE.match(text) and frame:
                    found = Traceback(frame[0], frame[1], frame[2], _short(text))
                break
            j += 1
        i = j
    return found


def _traceback_in_rank_streams(text: str) -> Traceback | None:
    """Interleaved ranks break a traceback apart: read each ``[rankN]:`` stream on its own."""
    streams: dict[str, list[str]] = {}
    for raw in re.split(r"\r\n|\r|\n", text.replace("\x00", "")):
        m = _RANK_PREFIX.match(raw)
        streams.setdefault(m.group(0).strip() if m else "", []).append(raw[m.end() :] if m else raw)
    if len(streams) < 2:
        return None
    for _, lines in sorted(streams.items()):
        tb = last_traceback([line.rstrip() for line in lines])
        if tb:
            return tb
    return None


def find_traceback(text: str, lines: Sequence[str] | None = None) -> Traceback | None:
    """The last traceback of a log: per rank when ranks interleave, else in the cleaned lines."""
    return _traceback_in_rank_streams(text) or last_traceback(clean_lines(text) if lines is None else lines)


def _scan(lines: list[str], signatures: Sequence[Signature]) -> list[Diagnosis]:
    """Each signature at its first line, in the order they appear."""
    found: list[tuple[int, Diagnosis]] = []
    for sig in signatures:
        for i, line in enumerate(lines):
            match = sig.pattern.search(line)
            if match:
                found.append((i, sig.matcher(lines, i, match)))
                break
    found.sort(key=lambda pair: pair[0])
    return [d for _, d in found]


def diagnose(log_text: str, events: Iterable[Mapping[str, Any]] = ()) -> list[Diagnosis]:
    """Every known failure signature in the log tail and the ``error`` events, first seen first."""
    lines = clean_lines(log_text)
    events = list(events)
    for event in events:
        if event.get("event") == "error":
            tail = event.get("traceback_tail")
            if isinstance(tail, str) and tail:
                lines.extend(clean_lines(tail))
            lines.append(f"{event.get('type', 'Error')}: {event.get('message', '')}")
    result = _scan(lines, _SIGNATURES) or _scan(lines, _FALLBACKS)
    if not result:
        tb = find_traceback(log_text, lines)
        if tb:
            result.append(
                Diagnosis(
                    "python-traceback",
                    f"{tb.exception} (last frame: {tb.file}:{tb.line} in {tb.function})",
                    f"open {tb.file} at line {tb.line}; `fab logs` shows the full traceback",
                    tb.exception,
                )
            )
        else:
            errors = [e for e in events if e.get("event") == "error"]
            if errors:
                last = errors[-1]
                text = f"{last.get('type', 'Error')}: {last.get('message', '')}"
                result.append(
                    Diagnosis(
                        "python-traceback",
                        _short(text),
                        "`fab logs` shows the full log around the error",
                        _short(text),
                    )
                )
    return result
