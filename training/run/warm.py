"""``python -m training warm``: compile every shape of a run before the run (and smoke-test it).

    python -m training warm --config NAME|PATH --cache-dir ROOT [--if-needed] [--section.key=value ...]

One process (one per GPU type) builds the run's data plan and a drafter exactly as the
trainer does, then runs one optimizer-free training step (forward + backward under the
trainer's autocast) for every distinct compiled shape, serially, printing progress per
shape: on GPU that is ``flex_attention`` forward and backward (and the compiled regions) with
the run's BlockMask for every (bucket, batch size) x mask variant; on CPU, where torch 2.13
has no flex backward, the compiled blockwise attention (``training.model.attention``). The chunked
loss runs too (it is not compiled: its chunk length depends on the batch's labels). Then
the Mega-Cache blob (``torch.compiler.save_cache_artifacts``) and ``manifest.json`` (with
``complete: true``) are written into ``ROOT/<key>/`` (``training.compile.cache``).

Shapes: the trainer pads each batch to its bucket's length, and a bucket's batches hold
``min(max_batch_size, token_budget // length)`` sequences except the bucket's last batch,
which holds the rest, so a bucket has one or two batch sizes (the same in every epoch).
Compiled code is specialised on all of them (``dynamic=False``), so all are warmed, at the
real batch size: a smaller batch would compile a shape the run never uses.

The target model is not loaded: a stand-in with the target's embedding/lm_head shapes and
random hidden states feeds the drafter (the compiled graphs depend on shapes and dtypes
only), so warming takes seconds to load instead of minutes and needs one GPU's memory for
the drafter alone.

A hybrid target (linear-attention layers, ``qwen3_5``) has Triton kernels of its own on the
fast path (flash-linear-attention): their first call compiles and autotunes them (~47 s on an
H200 for the 27B shape). On a GPU the warm-up therefore also runs one target forward per
shape on a cut of the target: its config with one layer of each kind (the first
``full_attention_interval`` layers) and random weights, in a process of its own started with the
warm-up (``training.run.kernel_warmup``), so it runs beside the drafter's compile instead of after it.
The kernels and their autotune keys
depend on the layer shapes, the dtype and the batch shape only, not on the depth or the
weights; their code and autotune results land in the key's ``triton/`` dir, which every target
rank uses (``training.run.core.ready_target``).

A dense target's forward is compiled per bucket shape (``compile.target``,
``training.model.target.compile_target``): every decoder layer runs one compiled graph with its
weights as graph inputs, so the warm-up compiles it on a one-layer cut of the target (random
weights), one forward per shape, and a warmed run's target misses nothing either.

``prepare_compile`` is what every training process that compiles runs before its first
step (the single trainer and the drafter ranks): the recompile guards, then the cache
activated before the first compile and, when asked to (the single trainer with
``compile.fail_on_recompile = true``), every shape pre-warmed in-process (serially, before any
thread starts) and then ``torch.compiler.set_stance("fail_on_recompile")``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from training.compile.cache import (
    CacheDir,
    CounterReporter,
    Manifest,
    ShapeRecord,
    activate,
    cache_counters,
    format_counters,
    pack_autotune,
    resolve_root,
    save_blob,
    start,
    start_workers,
    triton_version,
)
from training.config import ConfigError, RunConfig, config_to_dict, load_config
from training.contract import COMPILE_CACHE_ENV
from training.model import attention
from training.model.drafter import DFlashDrafter, sample_anchors
from training.progress import Progress
from training.run.core import build_drafter, compiles, load_train_data, set_threads, train_forward
from training.run.kernel_warmup import (
    Echo,
    KernelWarmup,
    KernelWarmupFailed,
    cut_target,
    error_summary,
    has_linear_attention,
    kernel_probe_target,
    print_line,
    run_target_shapes,
    warm_target_kernels,
)

if TYPE_CHECKING:
    from training.data.buckets import EpochPlanner

SHAPE_SECTIONS = ("model", "drafter", "data", "compile")  # what the compiled shapes depend on


def compile_shapes(planner: EpochPlanner) -> list[ShapeRecord]:
    """Every distinct (bucket, batch size, padded length) the trainer will run, in bucket order."""
    seen = sorted({(int(bucket), len(indices)) for bucket, indices in planner.plan(0)})
    return [ShapeRecord(bucket, size, planner.padded_length(bucket)) for bucket, size in seen]


def num_compiled_shapes(planner: EpochPlanner) -> int:
    """How many shapes each compiled function sees (the recompile limit's 'buckets')."""
    return max(1, len(compile_shapes(planner)))


def config_hash(config: RunConfig) -> str:
    """A hash of the config sections the compiled shapes depend on (not steps, lr, ...)."""
    data = config_to_dict(config)
    shaped = {section: data[section] for section in SHAPE_SECTIONS}
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


class StandInTarget(nn.Module):
    """The target's config, embedding and lm_head shapes with random weights (no decoder)."""

    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        text = getattr(config, "text_config", None) or config
        self.config = config
        hidden, vocab = int(text.hidden_size), int(text.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)
            p.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def target_config(config: RunConfig, folder: str) -> Any:
    """The target's HF config without loading weights."""
    if config.model.kind == "random":
        from training.model.tinymodel import target_text_config

        return target_text_config(config.model, config.model.vocab_size)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def warm_compiled_target(
    config: RunConfig,
    hf_config: Any,
    shapes: Sequence[ShapeRecord],
    *,
    device: torch.device,
    dtype: torch.dtype,
    echo: Echo = print_line,
) -> list[ShapeRecord]:
    """The compiled target forward of every shape (``compile.target``), on a one-layer cut of the
    target: every layer runs the same compiled graph with its weights as inputs, so the graphs
    (and their cache entries) are the full target's. [] when the target is not compiled
    (linear-attention layers)."""
    from training.model.target import compile_target

    probe = cut_target(hf_config, device, dtype)
    if not compile_target(probe, mode=config.compile.mode):
        echo("warm: the target has linear-attention layers: its forward runs eager, nothing to compile")
        return []
    done = run_target_shapes(probe, shapes, device=device, echo=echo, what="compiled target forward")
    del probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return done


def warm_step(
    drafter: DFlashDrafter,
    shape: ShapeRecord,
    *,
    device: torch.device,
    hidden_dtype: torch.dtype,
    generator: torch.Generator,
) -> int:
    """One optimizer-free training step of ``shape`` (random tokens, full-length rows): the
    training forward of ``core.drafter_step`` and its backward; gradients are dropped
    afterwards. Returns the labelled tokens."""
    cfg = drafter.cfg
    vocab = drafter.embed_tokens.weight.shape[0]
    b, t = shape.batch_size, shape.length
    ids = torch.randint(0, vocab, (b, t), generator=generator).to(device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    lengths = torch.full((b,), t, dtype=torch.long)
    hidden = torch.empty(b, t, drafter.fc.in_features, device=device, dtype=hidden_dtype).normal_()
    anchors = sample_anchors(mask, lengths, cfg.num_anchors, generator)
    out = train_forward(drafter, ids, mask, hidden, anchors)
    if out.num_tokens > 0:
        out.loss.backward()
    drafter.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.num_tokens


class WarmStepFailed(RuntimeError):
    """A shape's warm step failed; ``str()`` is one line: the shape, the error and, for a compile
    error, the compiler's own first error line (inductor puts it deep in a multi-line message)."""

    def __init__(self, shape: ShapeRecord, lo: int, hi: int, exc: BaseException) -> None:
        where = f"bucket {shape.bucket} [{lo}, {hi}) batch {shape.batch_size} x {shape.length}"
        super().__init__(f"warm: failed at {where}: {error_summary(exc)}")


def prewarm(
    drafter: DFlashDrafter,
    shapes: Sequence[ShapeRecord],
    boundaries: Sequence[int],
    *,
    device: torch.device,
    hidden_dtype: torch.dtype,
    echo: Echo = print_line,
) -> list[ShapeRecord]:
    """``warm_step`` every shape serially, printing one progress line each; shapes with seconds.
    The global RNG states are restored afterwards (a trainer's random stream is unchanged)."""
    generator = torch.Generator().manual_seed(0)
    done: list[ShapeRecord] = []
    cuda = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    for i, shape in enumerate(shapes, 1):
        started = time.monotonic()
        lo, hi = boundaries[shape.bucket], boundaries[shape.bucket + 1]
        try:
            with torch.random.fork_rng(devices=cuda):
                warm_step(drafter, shape, device=device, hidden_dtype=hidden_dtype, generator=generator)
        except Exception as exc:
            raise WarmStepFailed(shape, lo, hi, exc) from exc
        seconds = time.monotonic() - started
        done.append(ShapeRecord(shape.bucket, shape.batch_size, shape.length, round(seconds, 3)))
        echo(
            f"warm [{i}/{len(shapes)}] bucket {shape.bucket} [{lo}, {hi}): batch {shape.batch_size} x "
            f"{shape.length}: {seconds:.1f}s ({format_counters(cache_counters())})"
        )
    return done


def set_compile_guards(config: RunConfig, drafter: DFlashDrafter, num_shapes: int) -> int:
    """T2's recompile limit for ``num_shapes`` x the drafter's mask variants (or the config's)."""
    limit = attention.configure_compile(num_shapes, drafter.graphs_per_shape())
    if config.compile.recompile_limit > 0:
        torch._dynamo.config.recompile_limit = config.compile.recompile_limit
        limit = config.compile.recompile_limit
    return limit


def run_warm(
    config: RunConfig, root: Path, *, if_needed: bool = False, echo: Echo = print_line
) -> Manifest | None:
    """Warm ``root/<key>`` for ``config``; None when the config does not compile on this device."""
    from training.data.buckets import format_bucket_table
    from training.model.target import load_tokenizer, model_source, resolve_device, resolve_dtype

    started = time.monotonic()
    device = resolve_device(config.model.device)
    set_threads(config)
    if not compiles(config, device):
        if not if_needed:  # `fab train` warms if needed on every launch: no line there for a no-op
            why = "compile.enabled=auto compiles on GPUs only" if config.compile.enabled == "auto" else ""
            why = why or f"compile.enabled={config.compile.enabled}"
            echo(f"nothing to warm: this config runs without torch.compile on {device.type} ({why})")
        return None
    active = activate(root, device, load=False)
    cache = active.cache
    digest = config_hash(config)
    ready = cache.complete_manifest(digest) if if_needed else None
    if ready is not None and device.type == "cuda" and not ready.target_fast_path:
        ready = None  # warmed before the target's kernels were part of the warm-up
    if ready is not None:
        echo(f"warm: {cache.path} is already warm for {config.name} ({len(ready.shapes)} shapes)")
        return ready
    echo(f"warm: config {config.name} on {device}, cache {cache.path}")
    start_workers(device)  # ready by the first compile, after the data and the stand-in target
    if device.type == "cuda" and config.pipeline.topology:
        echo(
            f"warm: note: topology {config.pipeline.topology}: inductor's cache keys hold the device index, "
            f"so this warm-up serves ranks that see their GPU as {device} (CUDA_VISIBLE_DEVICES)"
        )
    if device.type == "cpu":
        attention.set_cpu_compile(True)
    folder, tok_dir = model_source(config)
    hf_config = target_config(config, folder)
    dtype = resolve_dtype(config.model.dtype, device)
    # The target's kernels warm in a process of their own, beside the drafter's compile below.
    hybrid_gpu = device.type == "cuda" and has_linear_attention(hf_config)
    kernel_warmup = KernelWarmup(config, hf_config, device, dtype) if hybrid_gpu else contextlib.nullcontext()
    with kernel_warmup as kernels:
        tokenizer = load_tokenizer(tok_dir)
        planner = load_train_data(config, tokenizer, cache.root / ".data-cache").planner
        echo(format_bucket_table(planner.table()))
        shapes = compile_shapes(planner)
        if kernels is not None:
            kernels.send_shapes(shapes)
        stand_in = StandInTarget(hf_config, device, dtype)
        drafter = build_drafter(config, stand_in, device, tokenizer)
        limit = set_compile_guards(config, drafter, len(shapes))
        echo(
            f"warm: {len(shapes)} shapes x {len(drafter.variants())} mask variants, recompile_limit={limit} "
            f"(fail_on_recompile_limit_hit), setup {time.monotonic() - started:.1f}s"
        )
        done = prewarm(drafter, shapes, planner.boundaries, device=device, hidden_dtype=dtype, echo=echo)
        target_fast_path, target_done, target_compiled = "n/a", [], False
        if kernels is not None:
            waited = time.monotonic()
            target_fast_path, target_done = kernels.result(echo)
            echo(
                f"warm: the target's kernels were ready {time.monotonic() - waited:.1f}s after the drafter's"
            )
        elif config.compile.target:
            target_done = warm_compiled_target(
                config, hf_config, shapes, device=device, dtype=dtype, echo=echo
            )
            target_compiled = bool(target_done)
    blob_bytes, entries = save_blob(cache.blob_path)
    autotuned = pack_autotune(cache)  # before the manifest: a complete manifest finds it there
    manifest = Manifest(
        key=cache.key.text,
        config=config.name,
        config_hash=digest,
        buckets=tuple(int(b) for b in planner.boundaries),
        shapes=tuple(done),
        variants=len(drafter.variants()),
        recompile_limit=limit,
        seconds=round(time.monotonic() - started, 3),
        torch=cache.key.torch,
        triton=triton_version(),
        device=cache.key.device,
        blob_bytes=blob_bytes,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        complete=True,
        counters=cache_counters(),
        target_fast_path=target_fast_path,
        target_shapes=tuple(target_done),
        target_compiled=target_compiled,
    )
    cache.write_manifest(manifest)
    echo(
        f"warm: done in {manifest.seconds:.1f}s; {cache.blob_path.name} {blob_bytes / 1e6:.1f} MB "
        f"({entries} entries), {format_counters(manifest.counters)}"
        + (f"; {cache.autotune_path.name}: {autotuned} Triton autotune results" if autotuned else "")
    )
    return manifest


def prepare_target_compile(
    config: RunConfig, planner: EpochPlanner, device: torch.device, *, echo: Echo
) -> CounterReporter:
    """A target rank's ``prepare_compile`` (its compiled target forward, ``compile.target``): the
    recompile guards for the run's shapes, the cache activated (blob loaded when warmed); returns
    the ``compile_cache`` reporter to call after every forward."""
    num_shapes = num_compiled_shapes(planner)
    limit = attention.configure_compile(num_shapes, 1)
    if config.compile.recompile_limit > 0:
        torch._dynamo.config.recompile_limit = limit = config.compile.recompile_limit
    echo(f"compile: target forward, recompile_limit={limit} for {num_shapes} shapes")
    return start(device, echo=echo)


def prepare_compile(
    config: RunConfig,
    drafter: DFlashDrafter,
    planner: EpochPlanner,
    device: torch.device,
    *,
    echo: Echo,
    prewarm_dtype: torch.dtype | None = None,
    target: nn.Module | None = None,
) -> CounterReporter:
    """Before a training process's first compiled step: CPU compile switched on where needed,
    the recompile guards for the run's shapes, the cache of ``$FLEET_COMPILE_CACHE`` activated
    (blob loaded when warmed) and, given ``prewarm_dtype`` (the target's hidden-state dtype) and
    ``compile.fail_on_recompile``, every shape pre-warmed here (the drafter's step and, given a
    compiled ``target``, its forward), then recompiles forbidden.
    Returns the ``compile_cache`` reporter to call after every step."""
    if device.type == "cpu":
        attention.set_cpu_compile(True)
    num_shapes = num_compiled_shapes(planner)  # (bucket, batch size) shapes
    limit = set_compile_guards(config, drafter, num_shapes)
    echo(f"compile: on, recompile_limit={limit} (fail_on_recompile_limit_hit) for {num_shapes} shapes")
    reporter = start(device, echo=echo)
    if config.compile.fail_on_recompile and prewarm_dtype is not None:
        shapes = compile_shapes(planner)
        total = len(shapes) * (2 if target is not None else 1)
        with Progress("compile", "pre-compiling the run's shapes", total, "shapes") as progress:

            def shape_done(line: str) -> None:  # both warm-ups print one line per shape done
                echo(line)
                progress.advance()

            bounds = planner.boundaries
            prewarm(drafter, shapes, bounds, device=device, hidden_dtype=prewarm_dtype, echo=shape_done)
            if target is not None:
                what = "compiled target forward"
                run_target_shapes(target, shapes, device=device, echo=shape_done, what=what)
        torch.compiler.set_stance("fail_on_recompile")
        echo(f"compile: {len(shapes)} shapes pre-warmed; stance fail_on_recompile (a new shape is an error)")
    return reporter


def warm_main(config_name: str, cache_dir: str, overrides: Sequence[str], *, if_needed: bool) -> int:
    """The ``warm`` subcommand; ConfigError (exit 2) for a bad config or cache dir."""
    config = load_config(config_name, list(overrides))
    root = resolve_root(cache_dir)
    if root is None:
        raise ConfigError(f"warm: give --cache-dir DIR (or set ${COMPILE_CACHE_ENV})")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"warm --cache-dir {root}: cannot create it ({exc.strerror})") from None
    try:
        run_warm(config, root, if_needed=if_needed)
    except WarmStepFailed as exc:
        traceback.print_exc()  # the whole story first; the one-line summary last (what fab shows)
        print(exc, file=sys.stderr, flush=True)
        return 1
    except KernelWarmupFailed as exc:  # already one line: the child's error or how it ended
        print(exc, file=sys.stderr, flush=True)
        return 1
    sys.stdout.flush()
    return 0


__all__ = [
    "CacheDir",
    "StandInTarget",
    "WarmStepFailed",
    "compile_shapes",
    "config_hash",
    "cut_target",
    "kernel_probe_target",
    "num_compiled_shapes",
    "prepare_compile",
    "prepare_target_compile",
    "prewarm",
    "run_target_shapes",
    "run_warm",
    "set_compile_guards",
    "warm_compiled_target",
    "warm_main",
    "warm_target_kernels",
]
