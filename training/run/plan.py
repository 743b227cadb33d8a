"""``python -m training plan``: the split advisor for N+M topologies.

A short probe on the device at hand measures, for the run config, the target forward rate
(tokens/s of one target rank) and the drafter step rate (tokens/s of one drafter rank,
forward + backward + optimizer step, on the probe's own hidden states). For a GPU count it
then predicts each split ``N+M``:

    throughput(N, M) = min(N * target_rate, M * drafter_rate * ddp_efficiency^(M>1))

(the pipeline is bounded by its slower role; the credit backpressure keeps the faster one
waiting, not queueing), and names the best split. The rates are real tokens per second over a
whole epoch: the probe measures computed (padded) tokens per second, which is what a batch's
time follows, and multiplies by the epoch's real / padded ratio (``fill_ratio`` over the epoch's
planned batches), not by its own few batches' ratio, which can be far from it (4 batches of the
qwen3-8b-h200 1+1 bucket held 14.7K real tokens each, a run of 39 steps 12.7K: a 16% too high rate).
``--target-rate``/``--drafter-rate`` skip the probe (pure arithmetic). ``fab plan`` runs it on a fleet target.

    python -m training plan --config qwen3-8b-h200 --gpus 8 [--batches 4] [--json] [--section.key=v]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from training.config import ConfigError, TrainingError


@dataclass(frozen=True)
class Rates:
    """Per-rank rates of one role, tokens/s (real tokens over an epoch, padding not counted)."""

    target_tokens_per_s: float
    drafter_tokens_per_s: float
    device: str = ""
    batches: int = 0
    tokens: int = 0
    target_fast_path: str = ""  # a hybrid target's linear attention: yes (kernels) | no (torch) | n/a
    epoch_fill: float = 1.0  # the epoch's real / padded tokens (the rates' conversion, ``fill_ratio``)


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    tokens_per_s: float
    bottleneck: str  # "target" | "drafter" | "balanced"
    target_busy: float  # predicted busy fraction of the target ranks
    drafter_busy: float

    def __str__(self) -> str:
        return f"{self.targets}+{self.drafters}"


def predict_splits(
    gpus: int, target_rate: float, drafter_rate: float, *, ddp_efficiency: float = 1.0
) -> list[Split]:
    """Every split N+M of ``gpus`` (N, M >= 1) with its predicted throughput (pure)."""
    if gpus < 2:
        raise ConfigError(f"plan --gpus {gpus}: an N+M split needs at least 2 GPUs")
    if target_rate <= 0 or drafter_rate <= 0:
        raise ConfigError(f"plan: rates must be > 0 (target {target_rate}, drafter {drafter_rate})")
    if not 0 < ddp_efficiency <= 1:
        raise ConfigError(f"plan --ddp-efficiency {ddp_efficiency}: must be in (0, 1]")
    splits = []
    for n in range(1, gpus):
        m = gpus - n
        supply = n * target_rate
        demand = m * drafter_rate * (ddp_efficiency if m > 1 else 1.0)
        rate = min(supply, demand)
        if abs(supply - demand) <= 1e-9 * max(supply, demand):
            bottleneck = "balanced"
        else:
            bottleneck = "target" if supply < demand else "drafter"
        splits.append(Split(n, m, rate, bottleneck, rate / supply, rate / demand))
    return splits


def fill_ratio(batches: Iterable[tuple[int, Sequence[int]]]) -> float:
    """Real / computed tokens of ``batches``, each (padded width, the rows' lengths) (pure)."""
    real = padded = 0
    for width, lengths in batches:
        real += sum(int(n) for n in lengths)
        padded += int(width) * len(lengths)
    return real / padded if padded else 1.0


def best_split(splits: list[Split]) -> Split:
    """The fastest split; ties go to fewer target ranks (more drafter headroom)."""
    return max(splits, key=lambda s: (round(s.tokens_per_s, 6), -s.targets))


def format_plan(rates: Rates, splits: list[Split]) -> str:
    best = best_split(splits)
    hybrid = rates.target_fast_path in ("yes", "no")
    path = f", linear-attention fast path {rates.target_fast_path}" if hybrid else ""
    lines = [
        f"probe on {rates.device or '?'}: target {rates.target_tokens_per_s:,.0f} tok/s per rank{path}, "
        f"drafter {rates.drafter_tokens_per_s:,.0f} tok/s per rank "
        f"({rates.batches} batches, {rates.tokens} tokens)",
        "split  predicted tok/s  bottleneck  target busy  drafter busy",
    ]
    for s in splits:
        mark = "  <- best" if s == best else ""
        lines.append(
            f"{s!s:>5}  {s.tokens_per_s:15,.0f}  {s.bottleneck:>10}  {s.target_busy:10.0%}  "
            f"{s.drafter_busy:11.0%}{mark}"
        )
    return "\n".join(lines)


def probe(config_name: str, overrides: list[str], batches: int, warmup: int) -> Rates:
    """Measure one target rank's forward rate and one drafter rank's step rate on this device.

    The two roles run one after the other, as they do on their own GPUs in an N+M run: first the
    target's forwards (timed after ``warmup`` untimed ones), keeping the hidden states the drafter
    needs; then the target's decoder layers move to the CPU (the drafter shares only the
    embedding and lm_head) and the drafter steps on those hidden states. So the probe's peak is
    max(target, drafter), not their sum: a 27B target (54 GB) and its 2B drafter (weights,
    AdamW state and a step's activations) do not fit on one 141 GB H200 together.
    """
    import torch

    from training.config import load_config
    from training.model.kernels import linear_attention_kernels
    from training.model.target import decoder_layers, target_forward
    from training.run.core import batch_anchors
    from training.run.single import Trainer

    config = load_config(config_name, overrides)
    scratch = Path(tempfile.mkdtemp(prefix="fleet-plan-"))
    trainer = Trainer(config, scratch)
    try:
        trainer.setup(quiet_data=True)
        device = trainer.device
        fast_path = linear_attention_kernels(trainer.target).fast_path

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        # Target: `warmup` untimed forwards, then `batches` timed ones. Kept for the drafter: the
        # first batch of each length bucket (each is its own compiled shape: the drafter's
        # warm-up) and the timed batches.
        buckets = len(trainer.data.planner.boundaries) - 1
        warm_batches: dict[int, tuple] = {}
        timed_batches: list[tuple] = []
        t_target = 0.0
        tokens = computed = i = 0
        limit = warmup + 20 * buckets
        while len(timed_batches) < batches:
            batch = trainer.next_batch()
            warming = i < warmup
            i += 1
            ids, mask = batch.input_ids.to(device), batch.loss_mask.to(device)
            sync()
            t0 = time.perf_counter()
            hidden = target_forward(trainer.target, ids, trainer.layer_ids)
            sync()
            item = (ids, mask, hidden, batch_anchors(config, mask, batch.lengths, batch.position))
            if batch.bucket not in warm_batches and (trainer.compiled or not warm_batches):
                warm_batches[batch.bucket] = item
            if warming or (trainer.compiled and len(warm_batches) < buckets and i < limit):
                continue
            t_target += time.perf_counter() - t0
            tokens += int(batch.lengths.sum())
            computed += ids.numel()
            timed_batches.append(item)

        for layer in decoder_layers(trainer.target):
            layer.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # Drafter: one step per kept bucket (compiles each shape), `warmup` more, then timed.
        first = next(iter(warm_batches.values()))
        for item in [*warm_batches.values(), *[first] * warmup]:
            trainer.drafter_step(*item)
        sync()
        t0 = time.perf_counter()
        for item in timed_batches:
            trainer.drafter_step(*item)
        sync()
        t_drafter = time.perf_counter() - t0
        # The epoch's batches padded as the trainer pads them.
        planner = trainer.data.planner
        sizes = [(b, planner.lengths[idx]) for b, idx in planner.plan(0)]
        fill = fill_ratio((planner.width(b, n, trainer.compiled), n) for b, n in sizes)
        return Rates(
            computed * fill / max(t_target, 1e-9),
            computed * fill / max(t_drafter, 1e-9),
            str(device),
            batches,
            tokens,
            fast_path,
            fill,
        )
    finally:
        trainer.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="config name or TOML path (as for train)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to split (default: the visible ones)")
    parser.add_argument("--batches", type=int, default=4, help="measured batches (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured batches first (compile, caches)")
    parser.add_argument(
        "--target-rate", type=float, default=0.0, help="skip the probe: target tok/s per rank"
    )
    parser.add_argument(
        "--drafter-rate", type=float, default=0.0, help="skip the probe: drafter tok/s per rank"
    )
    parser.add_argument("--ddp-efficiency", type=float, default=1.0, help="drafter scaling per extra rank")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str]) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0])]
        if bad:
            raise ConfigError(
                f"plan: unexpected argument {bad[0]!r}: overrides look like --section.key=value"
            )
        gpus = args.gpus
        if gpus <= 0:
            import torch

            gpus = torch.cuda.device_count() or 2
        if args.target_rate > 0 and args.drafter_rate > 0:
            rates = Rates(args.target_rate, args.drafter_rate, "given")
        else:
            if args.batches < 1 or args.warmup < 0:
                raise ConfigError("plan: --batches must be >= 1 and --warmup >= 0")
            rates = probe(args.config, extra, args.batches, args.warmup)
        splits = predict_splits(
            gpus, rates.target_tokens_per_s, rates.drafter_tokens_per_s, ddp_efficiency=args.ddp_efficiency
        )
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    best = best_split(splits)
    if args.json:
        print(
            json.dumps(
                {
                    "gpus": gpus,
                    "rates": asdict(rates),
                    "splits": [asdict(s) for s in splits],
                    "best": asdict(best),
                }
            )
        )
    else:
        print(format_plan(rates, splits))
        print(f"best: --topology {best} ({best.tokens_per_s:,.0f} tok/s predicted)")
    return 0
