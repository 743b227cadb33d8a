"""The status model of a run: events + log tail + liveness (+ GPUs) -> one frozen RunStatus (pure).

Inputs, all text or plain facts: the tail of ``events.jsonl`` (training/EVENTS.md, read with
``training.contract``), the tail of ``train.log``, the liveness facts of the tmux run (alive,
exit status, the target's clock, file mtimes), and optionally the GPU table. ``build_status``
is pure; ``fleet.status.fetch`` gathers its inputs, ``fleet.status.render`` draws the result.

States and transitions. The phase of the run comes from its ``phase`` events (a
``step`` event implies ``train``); across ranks an ``error`` on any rank wins, and
``done``/``stopped`` count only once every rank that started has reached one::

    (no run at all)                                  -> never
    (no event yet)                                   -> starting
    load_data | buckets | load_target | load_drafter -> loading
    compile                                          -> compiling
    train (or a step event)                          -> training
    eval                                             -> evaluating
    checkpoint                                       -> checkpointing
    done                                             -> finished
    stopped                                          -> stopped
    error                                            -> failed

The phase is the live launch's while its processes live: a launch (``fab train``, ``fab train``
again to resume, or the restart policy's next attempt) is the wrapper's, which writes its start
(``launched_at``) once it holds the run's lock; the events before it are an earlier launch's or
attempt's, whatever they ended with. So a live launch without a phase of its own is ``starting``,
and one whose phase is final (its trainer wrote ``done``/``stopped``/``error`` and is exiting)
reads as the phase it was in before, never as ended: ended means no process of the run lives.
Between two attempts of the restart policy (the wrapper's back-off) the run is ``restarted``.

then liveness decides:

    alive, attempt ended and a retry recorded after it -> restarted
    process gone, exit 0        -> finished (phase done) else stopped
    process gone, exit != 0     -> failed (the exit status is shown; kill -9 -> 137)
    process gone, no exit file  -> finished/stopped if the phase says so, else failed
    alive, non-final state, no activity and no log growth for stall_window_s -> stalled

Activity is any event but a ``progress`` event whose ``done`` did not move: a long phase reports
every 10 s (training/EVENTS.md), so a phase that progresses is never stalled, while one whose
reporter still beats but whose work stopped moving is, and the note names the phase and its
last progress.
    liveness unknown (--log)    -> the phase state as is, unless the log shows a fatal error
                                   (a traceback, a C++ abort, a crash): failed

A process that ended by SIGKILL (exit 137) is diagnosed with its likely causes: ``fab stop
--force`` (its stop_signal file), the kernel's OOM killer (its lines in the kernel log, when
readable), or a container stopped under it.

Exit codes of ``fab status`` (distinct from fleet.errors' 1-7): never, starting, loading,
compiling, training, evaluating, checkpointing, restarted and finished -> 0; stopped -> 10;
stalled -> 11; failed -> 12.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from fleet.inventory import STALL_WINDOW_S
from fleet.status.diagnose import (
    FATAL_SIGNATURES,
    Diagnosis,
    clean_lines,
    diagnose,
    find_traceback,
    killed_diagnosis,
    resume_words,
)
from training.contract import (
    EVENTS_FILE,
    BucketTable,
    TreeFigures,
    eval_set,
    find_bucket_table,
    parse_events,
    retry_pending,
    tree_figures,
)


class State(StrEnum):
    """A run's state (``fab status``'s ``state``, ``fab runs``'s): the values are the words shown."""

    NEVER = "never"  # no run on the target
    STARTING = "starting"
    LOADING = "loading"
    COMPILING = "compiling"
    TRAINING = "training"
    EVALUATING = "evaluating"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    STOPPED = "stopped"
    STALLED = "stalled"
    RESTARTED = "restarted"  # the restart policy's back-off: an attempt ended, the next one is due
    FAILED = "failed"
    LIVE = "live"  # `fab runs`: a run whose process is alive, whatever its phase

    @property
    def exit_code(self) -> int:
        """`fab status`'s exit code: 0, or 10 stopped / 11 stalled / 12 failed."""
        return {State.STOPPED: 10, State.STALLED: 11, State.FAILED: 12}.get(self, 0)


ENDED = (State.FINISHED, State.STOPPED, State.FAILED)  # the run's process is gone for good
STATE_EXIT_CODES: dict[str, int] = {state: state.exit_code for state in State if state is not State.LIVE}
PHASE_STATES: dict[str, State] = {
    "load_data": State.LOADING,
    "buckets": State.LOADING,
    "load_target": State.LOADING,
    "load_drafter": State.LOADING,
    "compile": State.COMPILING,
    "train": State.TRAINING,
    "eval": State.EVALUATING,
    "checkpoint": State.CHECKPOINTING,
    "done": State.FINISHED,
    "stopped": State.STOPPED,
    "error": State.FAILED,
}
FINAL_PHASES = ("done", "stopped", "error")


@dataclass(frozen=True)
class LoadProgress:
    what: str
    done: int
    total: int
    seconds: float | None = None


@dataclass(frozen=True)
class EvalFigure:
    """The last ``eval`` event of one eval set (``training.contract.eval_set``)."""

    set: str
    step: int | None
    tau_mean: float | None  # per round
    tau_prompt_mean: float | None  # per prompt, as z-lab's benchmark reports it

    @classmethod
    def from_event(cls, ev: Mapping[str, Any]) -> EvalFigure:
        return cls(
            set=eval_set(ev),
            step=_int(ev.get("step")),
            tau_mean=_num(ev.get("tau_mean")),
            tau_prompt_mean=_num(ev.get("tau_prompt_mean")),
        )


@dataclass(frozen=True)
class ServeFigure:
    """The drafter served by llama.cpp (``python -m training serve-bench``), against the target alone."""

    backend: str
    prompts: int
    best_draft: int
    best_speedup: float
    alone_tok_s: float
    best_tok_s: float
    engine_tau: float
    project_tau: float
    identical: bool

    @classmethod
    def from_event(cls, ev: Mapping[str, Any]) -> ServeFigure | None:
        drafts, rates, same = ev.get("draft_lengths"), ev.get("tok_s"), ev.get("identical")
        prompts = _int(ev.get("prompts"))
        if not (isinstance(drafts, list) and isinstance(rates, list) and isinstance(same, list) and prompts):
            return None
        if not drafts or len(drafts) != len(rates) or len(drafts) != len(same):
            return None
        best = _int(ev.get("best_draft"))
        best_rate = next((r for d, r in zip(drafts, rates, strict=True) if d == best), rates[0])
        return cls(
            backend=str(ev.get("backend", "")),
            prompts=prompts,
            best_draft=best or 0,
            best_speedup=_num(ev.get("best_speedup")) or 0.0,
            alone_tok_s=float(rates[0]),
            best_tok_s=float(best_rate),
            engine_tau=_num(ev.get("engine_tau")) or 0.0,
            project_tau=_num(ev.get("project_tau")) or 0.0,
            identical=all(n == prompts for n in same),
        )

    def text(self) -> str:
        same = "identical" if self.identical else "DIFFER"
        return (
            f"llama.cpp {self.backend}: {self.best_speedup:.2f}x at draft {self.best_draft} "
            f"({self.alone_tok_s:,.0f} -> {self.best_tok_s:,.0f} tok/s), {self.engine_tau:.2f} per round "
            f"(eval tau {self.project_tau:.2f}), greedy {same} on {self.prompts} prompts"
        )


@dataclass(frozen=True)
class PhaseProgress:
    """The last ``progress`` event of the live phase: ``done`` of ``total`` ``unit``."""

    phase: str
    what: str
    done: float
    total: float
    unit: str
    rate: float  # units per second since the phase's work began
    seconds: float
    ts: float

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total > 0 else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the phase's rate so far; None before any unit is done."""
        if self.total <= 0 or self.rate <= 0:
            return None
        return max(0.0, self.total - self.done) / self.rate

    def text(self) -> str:
        """``regenerating the data (16 greedy replies): 240/512 tokens (47%)``."""
        pct = f" ({100 * self.fraction:.0f}%)" if self.fraction is not None else ""
        total = f"/{self.total:,.0f}" if self.total > 0 else ""
        return f"{self.what}: {self.done:,.0f}{total} {self.unit}{pct}"


@dataclass(frozen=True)
class CompileCache:
    fxgraph_hit: int
    fxgraph_miss: int
    aotautograd_hit: int
    aotautograd_miss: int

    @property
    def warm_with_misses(self) -> bool:
        """A warm start (some hits) that still compiled something: the concurrent-compile risk."""
        hits = self.fxgraph_hit + self.aotautograd_hit
        return hits > 0 and self.fxgraph_miss + self.aotautograd_miss > 0


@dataclass(frozen=True)
class TargetPath:
    """What one target-forward rank runs (its ``target`` event): the linear-attention kernels."""

    rank: int
    model_type: str
    linear_layers: int
    kernels: Mapping[str, str]
    fast_path: str  # "yes" | "no" | "n/a"

    def summary(self) -> str:
        """``fast path yes (delta_rule fla, conv1d torch, gated_norm torch)``."""
        detail = ", ".join(f"{name} {source}" for name, source in self.kernels.items())
        return f"fast path {self.fast_path}" + (f" ({detail})" if detail else "")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    seconds: float
    ts: float


@dataclass(frozen=True)
class ErrorInfo:
    type: str
    message: str
    peer_host: str = ""  # an N+M rank's error: the host of the peer it lost (contract.ERROR_PEER_FIELDS)


@dataclass(frozen=True)
class GpuRow:
    index: int
    role: str  # "target" | "drafter" | "" (unknown)
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None


@dataclass(frozen=True)
class RunFacts:
    """What the target says about the run outside the events (None = not known)."""

    run_id: str = ""
    release: str = ""
    env: str = ""
    alive: bool | None = None  # tmux session with a live pane
    exit_code: int | None = None  # the run's exit status once it ended
    now: float | None = None  # the target's clock
    log_mtime: float | None = None
    events_mtime: float | None = None
    log_size: int | None = None
    started_at: float | None = None  # run.json's started_at
    # When the wrapper started the live attempt's trainer (LAUNCHED_AT_FILE: its launch, then each
    # restart); only the events from then on are this attempt's.
    launched_at: float | None = None
    stop_signal: str = ""  # what `fab stop` sent (TERM / KILL), "" when it never did
    kernel_log_readable: bool | None = None  # None: not read (only a SIGKILLed run's is)
    kernel_oom: tuple[str, ...] = ()  # the kernel's OOM-killer lines from the run's lifetime
    attempts: tuple[Mapping[str, Any], ...] = ()  # attempts.jsonl: ended attempts (restart policy)


@dataclass(frozen=True)
class RunStatus:
    """One picture of a run. ``exit_code`` is what ``fab status`` exits with."""

    target: str
    run_id: str
    release: str
    env: str
    state: str
    since: float | None
    phase: str
    alive: bool | None
    process_exit_code: int | None
    buckets: BucketTable | None
    load: LoadProgress | None
    step: int | None
    total_steps: int | None
    epoch: int | None
    loss: float | None
    loss_trend: float | None  # mean loss, last loss_window steps vs the loss_window before (-0.05: 5% lower)
    tau: float | None
    eval_tau: float | None  # the last held-out eval's tau_mean (per round)
    eval_tau_prompt: float | None  # its tau_prompt_mean (per prompt, as z-lab's benchmark reports it)
    tokens_per_s: float | None
    tokens_per_s_by_role: Mapping[str, float]
    eta_s: float | None
    gpus: tuple[GpuRow, ...]
    compile_cache: CompileCache | None
    last_checkpoint: Checkpoint | None
    last_error: ErrorInfo | None
    diagnosis: tuple[Diagnosis, ...]
    last_activity_age_s: float | None = None
    notes: tuple[str, ...] = field(default=())
    targets: tuple[TargetPath, ...] = field(default=())  # one per rank that runs the target forward
    # One continuous history across launches of the run dir (resumes, restarts): the launches seen
    # in the events read, where the live one resumed, and (step, loss) of the step rank, steps
    # strictly increasing (a step redone after a resume replaces the earlier one).
    segments: int = 0
    resumed_from: int | None = None
    checkpoint_s: float | None = None  # median write time of the checkpoints in the events read
    history: tuple[tuple[int, float | None], ...] = field(default=())
    # The restart policy: the attempt running (or last run) in this launch, 1 without restarts,
    # and why the attempt before it ended ("exit 137", "config-error (not retryable)", ...).
    attempt: int = 1
    last_cause: str = ""
    serve: ServeFigure | None = None  # the last `serve_bench` event: the drafter in llama.cpp
    tree: TreeFigures | None = None  # the last held-out eval's DDTree figures (tau per budget, cost)
    progress: PhaseProgress | None = None  # the live phase's last progress report
    loss_window: int | None = None  # steps in each window of loss_trend
    evals: tuple[EvalFigure, ...] = field(default=())  # each eval set's last eval, held_out first

    def target_paths(self) -> list[tuple[str, list[int]]]:
        """The distinct linear-attention paths of the hybrid target ranks, with their ranks."""
        groups: dict[str, list[int]] = {}
        for t in self.targets:
            if t.linear_layers > 0:
                text = f"{t.model_type}, {t.linear_layers} linear-attention layers: {t.summary()}"
                groups.setdefault(text, []).append(t.rank)
        return list(groups.items())

    def tree_json(self) -> dict[str, Any] | None:
        """The last eval's DDTree figures for ``--json``: budgets as string keys, and the line."""
        if self.tree is None:
            return None
        data = asdict(self.tree)
        for key in ("taus", "sizes", "speedups"):
            data[key] = {str(b): v for b, v in sorted(data[key].items())}
        shown = {"reference_budget": self.tree.reference_budget, "shown_budget": self.tree.shown_budget}
        return {**data, **shown, "text": self.tree.text()}

    @property
    def exit_code(self) -> int:
        return State(self.state).exit_code

    @property
    def final(self) -> bool:
        return self.state in (State.NEVER, *ENDED)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (NaN/inf -> null): state, phase, step, loss, tokens_per_s, diagnosis, ..."""
        data = asdict(self)
        data["diagnosis"] = [d.to_json() for d in self.diagnosis]
        data["tokens_per_s_by_role"] = dict(self.tokens_per_s_by_role)
        data["targets"] = [{**asdict(t), "kernels": dict(t.kernels)} for t in self.targets]
        data["exit_code"] = self.exit_code
        data["history"] = [{"step": step, "loss": loss} for step, loss in self.history]
        data["tree"] = self.tree_json()
        return _json_safe(data)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------- the human log


_LOADING = re.compile(r"Loading (\d+) (target|drafter) models?")
_LOADED = re.compile(r"Loaded in [\d.]+s")


def parse_load_from_log(log_text: str) -> LoadProgress | None:
    """``Loading 5 target models...`` + one ``Loaded in`` per model -> k of n (human log fallback)."""
    lines = clean_lines(log_text)
    progress: LoadProgress | None = None
    for i, line in enumerate(lines):
        m = _LOADING.search(line)
        if m:
            done = sum(1 for later in lines[i + 1 :] if _LOADED.search(later))
            total = int(m.group(1))
            progress = LoadProgress(m.group(2), min(done, total), total)
    return progress


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def run_phase(events: Sequence[Mapping[str, Any]]) -> tuple[str, float | None]:
    """The run's phase and the time it was entered, across ranks (see the module docstring)."""
    per_rank: dict[int, tuple[str, float]] = {}
    started: set[int] = set()
    last: tuple[str, float] | None = None
    for ev in events:
        rank = ev.get("rank", 0) if isinstance(ev.get("rank"), int) else 0
        kind = ev.get("event")
        ts = float(ev["ts"])
        phase: str | None = None
        if kind == "run_start":  # a new launch of the run dir (a resume): its phases start over
            started.add(rank)
            per_rank.pop(rank, None)
        elif kind == "phase" and isinstance(ev.get("phase"), str):
            phase = ev["phase"]
        elif kind in ("step", "balance") and per_rank.get(rank, ("", 0.0))[0] not in ("train", *FINAL_PHASES):
            phase = "train"
        elif kind == "done":
            phase = "done"
        elif kind == "error":
            phase = "error"
        if phase is None:
            continue
        if per_rank.get(rank, ("",))[0] == phase:
            continue
        per_rank[rank] = (phase, ts)
        if phase not in FINAL_PHASES:
            last = (phase, ts)
    if not per_rank:
        return "", None
    errors = [ts for p, ts in per_rank.values() if p == "error"]
    if errors:
        return "error", min(errors)
    ranks = started | set(per_rank)
    finals = [per_rank.get(r) for r in ranks]
    if all(f is not None and f[0] in FINAL_PHASES for f in finals):
        phases = {f[0] for f in finals if f}
        phase = "stopped" if "stopped" in phases else "done"
        return phase, max(f[1] for f in finals if f)
    return last if last else ("", None)


def launch_events(events: Sequence[Mapping[str, Any]], facts: RunFacts) -> list[Mapping[str, Any]]:
    """The events of the live launch's attempt: those from its ``launched_at`` on while a process
    of the run lives (the earlier ones are launches or attempts that ended); all of them when the
    run has ended or its liveness or launch time is not known."""
    if facts.alive and facts.launched_at is not None:
        return [ev for ev in events if float(ev["ts"]) >= facts.launched_at]
    return list(events)


def _final_event(ev: Mapping[str, Any]) -> bool:
    kind = ev.get("event")
    return kind in ("done", "error") or (kind == "phase" and ev.get("phase") in FINAL_PHASES)


def between_attempts(facts: RunFacts) -> bool:
    """The restart policy's back-off while the run lives (``training.contract.retry_pending``)."""
    return bool(facts.alive and facts.attempts and retry_pending(facts.attempts[-1], facts.launched_at))


def derive_state(
    phase: str,
    phase_since: float | None,
    facts: RunFacts,
    last_activity: float | None,
    stall_window_s: float,
) -> tuple[str, float | None, str]:
    """(state, since, note) from the phase and the liveness facts — the transitions in the docstring."""
    if between_attempts(facts):
        cause = str(facts.attempts[-1].get("cause", ""))
        return State.RESTARTED, _num(facts.attempts[-1].get("ts")), f"attempt ended ({cause}); restarting"
    state = PHASE_STATES.get(phase, State.STARTING)
    if facts.alive is False:
        ended = facts.log_mtime or last_activity
        if facts.exit_code is not None and facts.exit_code != 0:
            return State.FAILED, ended, f"exited with status {facts.exit_code}"
        if facts.exit_code == 0:
            return (State.FINISHED if phase == "done" else State.STOPPED), ended, "exited with status 0"
        if state in ENDED:
            return state, phase_since, "process gone"
        return State.FAILED, ended, "the run's process is gone and left no exit status"
    if facts.alive and state is State.STARTING:
        phase_since = facts.launched_at
    if facts.alive and state not in ENDED:
        if facts.now is not None and last_activity is not None:
            if facts.now - last_activity > stall_window_s:
                age = facts.now - last_activity
                return State.STALLED, last_activity, f"no progress, new event or log output for {age:.0f}s"
    return state, phase_since, ""


def continuous_events(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The events of a run dir as one history across its launches (pure).

    A resumed launch redoes the steps after its checkpoint: the ``step`` events the earlier launch
    wrote past that checkpoint are superseded. They are dropped when the launch's ``resume`` event
    (step k: steps > k of that rank) or, without one (a launch that found no checkpoint), its first
    step event at or below a step already seen arrives. What is left has strictly increasing steps
    per rank."""
    kept: list[Mapping[str, Any] | None] = []
    last_step: dict[int, int] = {}
    where: dict[int, list[int]] = {}  # rank -> indexes in kept of its step events, in order

    def drop_after(rank: int, step: int) -> None:
        idx = where.get(rank, [])
        while idx and kept[idx[-1]]["step"] > step:  # type: ignore[index]
            kept[idx.pop()] = None
        last_step[rank] = kept[idx[-1]]["step"] if idx else 0  # type: ignore[index]

    for ev in events:
        rank = ev["rank"] if isinstance(ev.get("rank"), int) else 0
        kind = ev.get("event")
        step = _int(ev.get("step"))
        if kind == "resume" and step is not None:
            drop_after(rank, step)
        elif kind == "step" and step is not None:
            if step <= last_step.get(rank, 0):
                drop_after(rank, step - 1)
            where.setdefault(rank, []).append(len(kept))
            last_step[rank] = step
        kept.append(ev)
    return [ev for ev in kept if ev is not None]


def _segments(events: Sequence[Mapping[str, Any]]) -> tuple[int, float | None, int | None]:
    """(launches seen, when the live one started, the step it resumed from) from ``run_start``
    events of the lowest rank (one per launch) and ``resume`` events."""
    starts = [ev for ev in events if ev.get("event") == "run_start"]
    if not starts:
        return 0, None, None
    low = min(ev["rank"] if isinstance(ev.get("rank"), int) else 0 for ev in starts)
    launches = [float(ev["ts"]) for ev in starts if (ev.get("rank") or 0) == low]
    since = launches[-1] if launches else None
    resumed = [
        _int(ev.get("step"))
        for ev in events
        if ev.get("event") == "resume" and since is not None and float(ev["ts"]) >= since
    ]
    return len(launches), since, resumed[0] if resumed else None


def median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def build_status(
    target: str,
    facts: RunFacts,
    events_text: str,
    log_text: str,
    *,
    stall_window_s: float = STALL_WINDOW_S,
    events_truncated: bool = False,
    gpus: Sequence[GpuRow] = (),
) -> RunStatus:
    """The whole picture from text and facts (pure)."""
    parsed = parse_events(events_text, truncated=events_truncated)
    events = continuous_events(parsed.events)
    segments, live_since, resumed_from = _segments(events)
    notes: list[str] = []
    if parsed.skipped:
        notes.append(f"{parsed.skipped} unreadable {EVENTS_FILE} line(s) skipped")

    buckets = None
    load = None
    cache_by_rank: dict[int, CompileCache] = {}
    # Steady-state speed: the median over the live launch's windows, per rank (a step event is a
    # window of one step, a balance event one of pipeline.balance_window_s); a slow first window
    # (compile, warm-up) or one that held a checkpoint does not move it.
    step_rates: dict[int, tuple[str, list[float]]] = {}
    balance_rates: dict[int, tuple[str, list[float]]] = {}
    checkpoint_times: list[float] = []
    steps: list[Mapping[str, Any]] = []
    step_rank: int | None = None
    checkpoint = None
    error = None
    eval_tau = eval_tau_prompt = None
    tree: TreeFigures | None = None
    evals: dict[str, EvalFigure] = {"held_out": EvalFigure("held_out", None, None, None)}
    serve: ServeFigure | None = None
    targets: dict[int, TargetPath] = {}
    progress: PhaseProgress | None = None
    progress_done: dict[tuple[int, str, str], float] = {}
    activity: float | None = None  # the last event that was not a beat without progress
    stop_info: tuple[str, int | None] | None = None  # a stop's (phase it interrupted, resume step)
    for ev in events:
        kind = ev["event"]
        rank = ev["rank"] if isinstance(ev.get("rank"), int) else 0
        role = ev["role"] if isinstance(ev.get("role"), str) else "single"
        if kind != "progress":
            activity = float(ev["ts"])
        if kind == "phase" and ev.get("phase") == "stopped" and isinstance(ev.get("during"), str):
            stop_info = (ev["during"], _int(ev.get("resume_step")))
        if kind == "progress" and _num(ev.get("done")) is not None and _num(ev.get("total")) is not None:
            key = (rank, str(ev.get("phase", "")), str(ev.get("what", "")))
            done = float(ev["done"])
            if key not in progress_done or done > progress_done[key]:
                activity = float(ev["ts"])
            progress_done[key] = done
            progress = PhaseProgress(
                key[1], key[2], done, float(ev["total"]), str(ev.get("unit", "")),
                _num(ev.get("rate")) or 0.0, _num(ev.get("seconds")) or 0.0, float(ev["ts"]),
            )  # fmt: skip
        elif kind == "buckets":
            buckets = BucketTable.from_event(ev) or buckets
        elif kind == "load_progress" and _int(ev.get("done")) is not None and _int(ev.get("total")):
            load = LoadProgress(str(ev.get("what", "")), ev["done"], ev["total"], _num(ev.get("seconds")))
        elif kind == "compile_cache":
            counts = [
                _int(ev.get(k)) or 0
                for k in ("fxgraph_hit", "fxgraph_miss", "aotautograd_hit", "aotautograd_miss")
            ]
            cache_by_rank[rank] = CompileCache(*counts)
        elif kind == "step" and _int(ev.get("step")) is not None:
            if step_rank is None:
                step_rank = rank
            if rank == step_rank:
                steps.append(ev)
            rate = _num(ev.get("tokens_per_s"))
            if rate is not None and (live_since is None or ev["ts"] >= live_since):
                step_rates.setdefault(rank, (role, []))[1].append(rate)
        elif kind == "balance" and _num(ev.get("tokens_per_s")) is not None:
            if live_since is None or ev["ts"] >= live_since:
                balance_rates.setdefault(rank, (role, []))[1].append(float(ev["tokens_per_s"]))
        elif kind == "checkpoint" and _int(ev.get("step")) is not None:
            checkpoint = Checkpoint(
                ev["step"], str(ev.get("path", "")), _num(ev.get("seconds")) or 0.0, ev["ts"]
            )
            if _num(ev.get("seconds")) is not None:
                checkpoint_times.append(float(ev["seconds"]))
        elif kind == "checkpoint_set_aside":  # failed its check at a resume: renamed, never deleted
            notes.append(
                f"checkpoint step {ev.get('step')} failed its check ({ev.get('reason', '')}): "
                f"set aside as {ev.get('moved_to', '')}"
            )
        elif kind == "serve_bench":
            serve = ServeFigure.from_event(ev) or serve
        elif kind == "eval":
            figure = EvalFigure.from_event(ev)
            evals[figure.set] = figure
            if figure.set == "held_out":  # eval_tau: not the general set's nor the memorisation check's
                eval_tau, eval_tau_prompt = figure.tau_mean, figure.tau_prompt_mean
                tree = tree_figures(ev)
        elif kind == "target" and isinstance(ev.get("kernels"), dict):
            kernels = {str(k): str(v) for k, v in ev["kernels"].items()}
            linear = _int(ev.get("linear_layers")) or 0
            targets[rank] = TargetPath(
                rank, str(ev.get("model_type", "")), linear, kernels, str(ev.get("fast_path", ""))
            )
        elif kind == "error":
            error = ErrorInfo(
                str(ev.get("type", "")), str(ev.get("message", "")), str(ev.get("peer_host", ""))
            )

    if buckets is None:
        buckets = find_bucket_table(log_text)
    if load is None:
        load = parse_load_from_log(log_text)
    if error is None:
        tb = find_traceback(log_text)
        if tb:
            kind, _, message = tb.exception.partition(": ")
            error = ErrorInfo(kind, message)

    diagnosis = diagnose(log_text, events)
    if facts.alive is False:
        killed = killed_diagnosis(
            facts.exit_code,
            facts.stop_signal,
            facts.kernel_log_readable,
            facts.kernel_oom,
            checkpoint.step if checkpoint else None,
        )
        diagnosis = [*diagnosis, killed] if killed else diagnosis  # the kill came last
    launch = launch_events(events, facts)
    phase, phase_since = run_phase(launch)
    if facts.alive and phase in FINAL_PHASES:  # reported its end, but a process of it still lives
        notes.append(f"the run reported {phase}; its processes are still exiting")
        phase, phase_since = run_phase([ev for ev in launch if not _final_event(ev)])
    # Only the human log says so (events missing or rotated); its lines of earlier launches are
    # not the live launch's.
    if not phase and (load or buckets) and not (facts.alive and facts.launched_at is not None):
        phase = "load_target" if load else "buckets"
    fatal = error is not None or any(d.signature in FATAL_SIGNATURES for d in diagnosis)
    if facts.alive is None and fatal and phase not in FINAL_PHASES:
        phase, phase_since = "error", None  # an offline log that ends in a crash
    # A beat without progress is no activity, and neither is the events file's mtime it moved.
    beating = bool(events) and events[-1]["event"] == "progress" and activity != events[-1]["ts"]
    events_mtime = None if beating else facts.events_mtime
    times = [
        t for t in (activity, facts.log_mtime, events_mtime, facts.launched_at if facts.alive else None) if t
    ]
    last_activity = max(times) if times else None
    if progress is not None and (progress.phase != phase or (phase_since and progress.ts < phase_since)):
        progress = None  # an earlier phase's
    if progress is not None and steps and steps[-1]["ts"] > progress.ts:
        progress = None  # the first step's compile, done since
    state, since, note = derive_state(phase, phase_since, facts, last_activity, stall_window_s)
    if note and state == "stalled" and progress is not None and facts.now is not None:
        age = facts.now - progress.ts
        note += f" (phase {phase}: {progress.text()}, still reported {age:.0f}s ago but not moving)"
    if note:
        notes.append(note)
    if state == "stopped" and stop_info is not None:
        during, resume_step = stop_info
        where = "between steps" if during == "train" else f"during {during}"
        notes.append(f"stopped {where}: {resume_words(resume_step)}")

    last = steps[-1] if steps else None
    step_median = {rank: median(rates) or 0.0 for rank, (_, rates) in step_rates.items()}
    by_role: dict[str, float] = {}
    for rank in sorted(step_rates.keys() | balance_rates.keys()):
        role, rates = balance_rates.get(rank) or step_rates[rank]
        by_role[role] = by_role.get(role, 0.0) + (median(rates) or 0.0)
    live_steps = [s for s in steps if live_since is None or s["ts"] >= live_since]
    cache = None
    if cache_by_rank:
        cache = CompileCache(
            *(sum(getattr(c, f) for c in cache_by_rank.values()) for f in CompileCache.__dataclass_fields__)
        )
    slow = sorted(t.rank for t in targets.values() if t.fast_path == "no")
    if slow:
        notes.append(
            f"target rank(s) {', '.join(map(str, slow))} run the linear-attention torch fallback "
            "(~1.5x slower): the env lacks fla-core (envs/train pins it)"
        )
    if cache and cache.warm_with_misses:
        notes.append("warm compile cache but misses: something recompiled (concurrent-compile risk)")
    trend = loss_trend([(int(s["step"]), _num(s.get("loss"))) for s in steps])
    eta: float | None = None
    if state not in ("finished", "stopped", "failed", "stalled", "restarted"):
        if progress is not None:  # a long phase: its own rate
            eta = progress.eta_s
        elif state == "training":
            bpe = buckets.batches_per_epoch if buckets else None
            eta = eta_seconds(live_steps, bpe, origin=(phase_since, resumed_from or 0))

    return RunStatus(
        target=target,
        run_id=facts.run_id,
        release=facts.release,
        env=facts.env,
        state=state,
        since=since,
        phase=phase,
        alive=facts.alive,
        process_exit_code=facts.exit_code,
        buckets=buckets,
        load=load,
        step=_int(last.get("step")) if last else None,
        total_steps=_int(last.get("total_steps")) if last else None,
        epoch=_int(last.get("epoch")) if last else None,
        loss=_num(last.get("loss")) if last else None,
        loss_trend=trend[0] if trend else None,
        loss_window=trend[1] if trend else None,
        tau=_num(last.get("tau")) if last else None,
        eval_tau=eval_tau,
        eval_tau_prompt=eval_tau_prompt,
        evals=tuple(f for f in evals.values() if f.tau_mean is not None),
        tokens_per_s=sum(step_median.values()) if step_median else None,
        tokens_per_s_by_role=by_role,
        eta_s=eta,
        gpus=tuple(gpus),
        compile_cache=cache,
        last_checkpoint=checkpoint,
        last_error=error,
        diagnosis=tuple(diagnosis),
        last_activity_age_s=(facts.now - last_activity) if facts.now and last_activity else None,
        notes=tuple(notes),
        targets=tuple(targets[r] for r in sorted(targets)),
        segments=segments,
        resumed_from=resumed_from,
        checkpoint_s=median(checkpoint_times),
        history=tuple((s["step"], _num(s.get("loss"))) for s in steps),
        attempt=_attempt(facts.attempts),
        last_cause=str(facts.attempts[-1].get("cause", "")) if facts.attempts else "",
        serve=serve,
        tree=tree,
        progress=progress if state not in ("finished", "stopped", "failed") else None,
    )


def _attempt(attempts: Sequence[Mapping[str, Any]]) -> int:
    """The attempt now running (after a restart: the last ended one + 1) or last run."""
    if not attempts:
        return 1
    last = attempts[-1]
    n = _int(last.get("attempt")) or len(attempts)
    return n + 1 if last.get("retry") is True else n


def loss_trend(
    points: Sequence[tuple[int, float | None]], window_steps: int = 50
) -> tuple[float, int] | None:
    """(relative change, window): the mean loss of the step events in the last ``window`` steps vs
    the mean of those in the ``window`` steps before them; ``window`` is ``window_steps``, or half
    the steps logged when fewer. None until each window holds two logged steps. Recent means
    recent: a run's first steps (a loss of 60+ at step 1) leave the figure once they are more than
    two windows back."""
    values = [(step, v) for step, v in points if v is not None and math.isfinite(v)]
    if len(values) < 4:
        return None
    last = values[-1][0]
    window = max(1, min(window_steps, last // 2))
    recent = [v for step, v in values if step > last - window]
    before = [v for step, v in values if last - 2 * window < step <= last - window]
    if len(recent) < 2 or len(before) < 2:
        return None
    mean_before, mean_recent = sum(before) / len(before), sum(recent) / len(recent)
    return ((mean_recent - mean_before) / abs(mean_before), window) if mean_before else None


def eta_seconds(
    steps: Sequence[Mapping[str, Any]],
    batches_per_epoch: int | None = None,
    window: int = 20,
    origin: tuple[float | None, int] = (None, 0),
) -> float | None:
    """Seconds to ``total_steps`` of one rank's step events, at the pace the rest will run.

    The pace is the recent step events' within the current epoch (the first epoch of a run that
    caches the target's hidden states runs the target, the later ones do not). While that first
    epoch runs, the steps after it are priced without the target's share of a step (the step
    events' ``target_s`` of ``step_s``, training/EVENTS.md), given the epoch's length in batches
    (the ``buckets`` event; one batch per step). With one step event so far, the pace is that
    step's since ``origin`` (when training began, at which step): the first step's warm-up
    included, so an overestimate until the second."""
    if not steps:
        return None
    last = steps[-1]
    epoch = _int(last.get("epoch"))
    same = [s for s in steps if _int(s.get("epoch")) == epoch]
    recent = list((same if len(same) >= 2 else steps)[-window:])
    if len(recent) >= 2:
        first_ts, first_step = float(recent[0]["ts"]), int(recent[0]["step"])
    elif origin[0] is not None:
        first_ts, first_step = origin
    else:
        return None
    done = last["step"] - first_step
    elapsed = float(last["ts"]) - first_ts
    total = _int(last.get("total_steps"))
    if done <= 0 or elapsed <= 0 or total is None:
        return None
    pace = elapsed / done
    left = max(0, total - last["step"])
    timed = [s for s in recent if _num(s.get("target_s")) is not None and _num(s.get("step_s"))]
    if epoch == 0 and timed and batches_per_epoch:
        share = sum(float(s["target_s"]) for s in timed) / sum(float(s["step_s"]) for s in timed)
        in_epoch = min(left, max(0, batches_per_epoch - last["step"]))
        return in_epoch * pace + (left - in_epoch) * pace * max(0.0, 1.0 - share)
    return left * pace
