"""``python -m training serve-bench``: the trained drafter in llama.cpp, against the target alone.

    python -m training serve-bench --run-dir D [--draft-lengths 3,7] [--prompts N] [--max-new-tokens N]
        [--engine-args "-bs ..."]

On the run's held-out prompts (the eval's: ``TrainData.eval_prompts``, same count, length and
order), greedy, with the newest checkpoint:

1. the project's own acceptance (``training.run.eval.evaluate_acceptance``, draft length
   block - 1) on exactly these prompts;
2. the checkpoint exported (``training.export``) and converted to GGUF with llama.cpp's converter,
   the target as GGUF (``training.engines.gguf``);
3. llama-server with the target alone, then with the drafter (``--spec-type draft-dflash``) at each
   draft length (default: block - 1 and a few shorter ones), each a fresh server
   (``training.engines.server``): decode tokens/s, drafted / accepted / rounds from the server's
   counters, and the greedy tokens, compared with the target alone's (speculative decoding with
   greedy verification changes speed, not the text, where the engine's arithmetic does not depend
   on how many tokens one forward holds: llama.cpp's CPU backend; its CUDA backend is not batch
   invariant, so a block verified at once can part from one-token decoding at a near tie,
   ggml-org/llama.cpp#27407; ``first_diff`` says where the texts part).

Result (``ServeBench``): one ``serve_bench`` event in the run dir, ``<run_dir>/serve-bench.json``,
and the table on stdout. ``agreement`` is the engine's mean accepted length per round at draft
length block - 1 minus the project's tau_mean on the same prompts.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.config import ConfigError, read_config
from training.engines.gguf import export_gguf
from training.engines.llamacpp import LlamaBuild, default_cache_root, ensure_llamacpp
from training.engines.server import EngineRun, run_setting

RESULT_FILE = "serve-bench.json"


@dataclass(frozen=True)
class Row:
    """One engine setting: ``draft`` 0 is the target alone."""

    draft: int
    tokens: int
    tok_s: float
    speedup: float
    drafted: int
    accepted: int
    rounds: int
    accept_rate: float
    mean_len: float
    identical: int  # prompts whose greedy tokens equal the target alone's
    first_diff: int  # median index of the first differing token over the prompts that differ; -1: none


@dataclass(frozen=True)
class ServeBench:
    """The serving benchmark of one checkpoint (see the module docstring)."""

    step: int
    prompts: int
    max_new_tokens: int
    block_size: int
    backend: str  # "cpu" / "cuda"
    threads: int
    rows: tuple[Row, ...]
    project_tau: float
    engine_tau: float  # mean accepted length per round at draft length block - 1
    agreement: float  # engine_tau - project_tau
    best_draft: int
    best_speedup: float
    all_identical: bool
    drafter_gguf: str
    target_gguf: str
    seconds: float
    engine_args: tuple[str, ...] = ()  # llama-server flags beyond serve-bench's own, every setting

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def event_fields(self) -> dict[str, Any]:
        """The ``serve_bench`` event (training/EVENTS.md): one list entry per row, the target alone first."""
        return {
            "step": self.step,
            "prompts": self.prompts,
            "backend": self.backend,
            "draft_lengths": [r.draft for r in self.rows],
            "tok_s": [r.tok_s for r in self.rows],
            "mean_len": [r.mean_len for r in self.rows],
            "accept_rate": [r.accept_rate for r in self.rows],
            "identical": [r.identical for r in self.rows],
            "first_diff": [r.first_diff for r in self.rows],
            "best_draft": self.best_draft,
            "best_speedup": self.best_speedup,
            "engine_tau": self.engine_tau,
            "project_tau": self.project_tau,
            "agreement": self.agreement,
            "all_identical": self.all_identical,
            "engine_args": list(self.engine_args),
        }

    def text(self) -> str:
        lines = [
            f"serve-bench step {self.step}: {self.prompts} held-out prompts x <= {self.max_new_tokens} "
            f"tokens, greedy, llama.cpp {self.backend} ({self.threads} threads)"
            + (f", llama-server {shlex.join(self.engine_args)}" if self.engine_args else ""),
            f"{'draft':>5} {'tok/s':>8} {'speedup':>8} {'accepted/drafted':>17} {'per round':>9} identical",
        ]
        for r in self.rows:
            name = "alone" if r.draft == 0 else str(r.draft)
            acc = f"{r.accepted}/{r.drafted} ({r.accept_rate:.0%})" if r.draft else "-"
            per = f"{r.mean_len:.3f}" if r.draft else "-"
            part = f" (the others part at token {r.first_diff}, median)" if r.first_diff >= 0 else ""
            lines.append(
                f"{name:>5} {r.tok_s:8.1f} {r.speedup:7.2f}x {acc:>17} {per:>9} "
                f"{r.identical:>4}/{self.prompts}{part}"
            )
        lines.append(
            f"best: draft {self.best_draft}, {self.best_speedup:.2f}x; engine {self.engine_tau:.3f} vs "
            f"project tau {self.project_tau:.3f} per round (diff {self.agreement:+.3f}); greedy texts "
            + ("identical" if self.all_identical else "DIFFER")
        )
        return "\n".join(lines)


def summarize(
    runs: list[EngineRun],
    *,
    step: int,
    max_new_tokens: int,
    block_size: int,
    backend: str,
    threads: int,
    project_tau: float,
    drafter_gguf: Path,
    target_gguf: Path,
    seconds: float,
    engine_args: Sequence[str] = (),
) -> ServeBench:
    """The table from the engine runs (``runs[0]``: the target alone). Pure: tested on its own."""
    alone = runs[0]
    if alone.draft != 0:
        raise ValueError("runs[0] must be the target alone")
    rows = []
    for run in runs:
        diffs = sorted(
            _first_diff(a.tokens, b.tokens)
            for a, b in zip(alone.completions, run.completions, strict=True)
            if (a.tokens, a.text) != (b.tokens, b.text)
        )
        rows.append(
            Row(
                draft=run.draft,
                tokens=run.tokens,
                tok_s=round(run.tok_s, 2),
                speedup=round(run.tok_s / alone.tok_s, 3) if alone.tok_s else 0.0,
                drafted=run.drafted,
                accepted=run.accepted,
                rounds=run.rounds,
                accept_rate=round(run.accept_rate, 4),
                mean_len=round(run.mean_len, 4),
                identical=len(alone.completions) - len(diffs),
                first_diff=diffs[len(diffs) // 2] if diffs else -1,
            )
        )
    drafts = [r for r in rows if r.draft]
    best = max(drafts, key=lambda r: r.speedup) if drafts else rows[0]
    full = next((r for r in drafts if r.draft == block_size - 1), None)
    engine_tau = full.mean_len if full else 0.0
    return ServeBench(
        step=step,
        prompts=len(alone.completions),
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        backend=backend,
        threads=threads,
        rows=tuple(rows),
        project_tau=round(project_tau, 4),
        engine_tau=engine_tau,
        agreement=round(engine_tau - project_tau, 4) if full else 0.0,
        best_draft=best.draft,
        best_speedup=best.speedup,
        all_identical=all(r.identical == len(alone.completions) for r in rows),
        drafter_gguf=str(drafter_gguf),
        target_gguf=str(target_gguf),
        seconds=round(seconds, 1),
        engine_args=tuple(engine_args),
    )


def _first_diff(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Where two completions part: the first differing index (the shorter's length for a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def parse_lengths(text: str) -> list[int] | None:
    """``"3,7"`` -> [3, 7]; "" -> None (the defaults)."""
    if not text.strip():
        return None
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--draft-lengths {text!r}: expected numbers like 3,7") from None


def parse_engine_args(text: str) -> tuple[str, ...]:
    """``"-bs --foo 1"`` -> its flags (shell words); the port, models and draft flags are serve-bench's."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(f"--engine-args {text!r}: {exc}") from None
    own = {"-m", "--model", "-md", "--model-draft", "--port", "--host", "--spec-type", "--spec-draft-n-max"}
    if taken := sorted(own.intersection(words)):
        raise ConfigError(f"--engine-args: {', '.join(taken)} is set by serve-bench itself; leave it out")
    return words


def default_draft_lengths(block_size: int) -> list[int]:
    full = block_size - 1
    return sorted({n for n in (1, 3, full // 2, full) if 1 <= n <= full})


def bench_lengths(requested: list[int] | None, block_size: int) -> list[int]:
    """The draft lengths to serve: those asked for (else the defaults) and always block - 1, the
    length the project's eval drafts, where the agreement is read."""
    lengths = sorted({*(requested or default_draft_lengths(block_size)), block_size - 1})
    if any(not 1 <= n < block_size for n in lengths):
        raise ConfigError(
            f"serve-bench --draft-lengths {lengths}: each must be 1..{block_size - 1} "
            f"(block size {block_size})"
        )
    return lengths


def serve_bench(
    run_dir: Path,
    *,
    draft_lengths: list[int] | None = None,
    num_prompts: int = 0,
    max_new_tokens: int = 0,
    threads: int = 0,
    build: LlamaBuild | None = None,
    engine_args: Sequence[str] = (),
) -> ServeBench:
    """Measure (see the module docstring); prints the table, emits the event, writes the JSON."""
    import torch

    from training.export import export_run
    from training.model.smol import gguf_path
    from training.model.target import model_source
    from training.run.eval import evaluate_acceptance
    from training.run.single import Trainer

    t0 = time.monotonic()
    run_dir = run_dir.resolve()
    config = read_config(run_dir)
    build = build or ensure_llamacpp(default_cache_root())
    block = config.drafter.block_size
    lengths = bench_lengths(draft_lengths, block)
    max_new = max_new_tokens or config.eval.max_new_tokens
    trainer = Trainer(config, run_dir, eval_only=True)
    try:
        trainer.setup(quiet_data=True)
        if trainer.step == 0:
            raise ConfigError(f"{run_dir} has no checkpoint yet: serve-bench a trained drafter")
        prompts = trainer.data.eval_prompts(
            config.eval.prompt_tokens, num_prompts or config.data.eval_prompts
        )
        if not prompts:
            raise ConfigError(f"{run_dir}: the run holds out no prompts (data.eval_prompts = 0)")
        with torch.no_grad():
            project = evaluate_acceptance(
                trainer.target,
                trainer.drafter,
                prompts,
                trainer.layer_ids,
                max_new,
                eos_token_id=trainer.tokenizer.eos_token_id,
            )
        step = trainer.step
        exported = export_run(run_dir, run_dir / "export", step=step)
        folder, _ = model_source(config)
        shipped = gguf_path() if config.model.kind == "smol" else None
        pair = export_gguf(build, exported.path, Path(folder), run_dir / "gguf", shipped_target=shipped)
        n_threads = threads or os.cpu_count() or 1
        gpu_layers = 999 if build.cuda else 0
        runs = [
            run_setting(
                build,
                pair.target,
                pair.drafter if n else None,
                n,
                prompts,
                max_new,
                run_dir / "logs",
                threads=n_threads,
                gpu_layers=gpu_layers,
                extra=engine_args,
            )
            for n in [0, *lengths]
        ]
        result = summarize(
            runs,
            step=step,
            max_new_tokens=max_new,
            block_size=block,
            backend="cuda" if build.cuda else "cpu",
            threads=n_threads,
            project_tau=project.tau_mean,
            drafter_gguf=pair.drafter,
            target_gguf=pair.target,
            seconds=time.monotonic() - t0,
            engine_args=engine_args,
        )
        (run_dir / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=2) + "\n")
        trainer.events.emit("serve_bench", **result.event_fields())
        print(result.text(), flush=True)
        return result
    finally:
        trainer.close()
