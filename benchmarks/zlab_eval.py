"""The acceptance of an exported drafter under z-lab's own decoding loop: the second evaluator.

fleet's eval (``python -m training eval``, training/run/eval.py) is fleet's code judging fleet's
drafter. This runs the method's authors' loop instead: ``dflash.model.dflash_generate`` from the
``dflash`` package on PyPI (z-lab/dflash, 0.1.0), which loads the exported folder with its own
``DFlashDraftModel.from_pretrained`` (its own attention, masks, KV caches for both models) and
verifies greedily (temperature 0) against the same target. The prompts are the ones fleet's eval
reads (the run's config: its data, split, ``eval.prompt_tokens``, ``eval.num_prompts``,
``eval.max_new_tokens``, the tokenizer's EOS as the stop token), so the two figures differ only
where the two loops do. z-lab's ``max_new_tokens`` counts the prefill's token, fleet's counts the
tokens after it: z-lab gets one more, so both decode the same tokens in the same rounds; z-lab then
cuts a prompt's last round at the length limit or the stop token, fleet counts it whole.

``acceptance_lengths`` (one per round: the accepted drafts + the bonus token, cut at the stop
token or the length limit) is what z-lab's benchmark averages: ``tau_prompt_mean`` is each
prompt's mean over its rounds, then over prompts (their figure); ``tau_mean`` is the mean over
every round (fleet's "per round"). Rounds are counted with ``return_stats=True``, whose timer
calls ``torch.cuda.synchronize()``; on a CPU the timer is the plain clock (the figures here do
not use the times).

Usage: ``python benchmarks/zlab_eval.py --run-dir RUN --export FOLDER [--eval.KEY=VALUE ...]``
prints one JSON line. The ``dflash`` package is a dev dependency (pyproject.toml); on the GPU
machine it is carried as a wheel (benchmarks/gpu/wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class ZlabResult:
    """z-lab's acceptance lengths over the eval prompts (definitions in the module docstring)."""

    tau_mean: float
    tau_prompt_mean: float
    rounds: int
    prompts: int
    per_prompt: tuple[tuple[int, ...], ...]  # each prompt's acceptance_lengths
    seconds: float
    dflash_version: str

    def text(self) -> str:
        return (
            f"z-lab dflash {self.dflash_version}: tau_mean={self.tau_mean:.3f} per round, "
            f"{self.tau_prompt_mean:.3f} per prompt over {self.rounds} rounds of {self.prompts} prompts "
            f"({self.seconds:.1f}s)"
        )


def summarise(per_prompt: list[list[int]], seconds: float, version: str) -> ZlabResult:
    """The two means of z-lab's per-round lengths; a prompt without a round (its first token is the
    stop token) counts in neither, as in fleet's eval."""
    kept = [lengths for lengths in per_prompt if lengths]
    rounds = sum(len(lengths) for lengths in kept)
    if not kept:
        raise ValueError("z-lab eval: no prompt had a decoding round")
    return ZlabResult(
        tau_mean=sum(sum(lengths) for lengths in kept) / rounds,
        tau_prompt_mean=sum(sum(lengths) / len(lengths) for lengths in kept) / len(kept),
        rounds=rounds,
        prompts=len(kept),
        per_prompt=tuple(tuple(lengths) for lengths in per_prompt),
        seconds=seconds,
        dflash_version=version,
    )


def zlab_lengths(
    export: Path, target: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> list[list[int]]:
    """Each prompt's ``acceptance_lengths`` from z-lab's ``dflash_generate`` (greedy), the drafter
    read from ``export`` by z-lab's ``DFlashDraftModel``; ``max_new_tokens`` as fleet's eval counts
    them (the tokens after the prefill's)."""
    import dflash.model as zlab
    import torch

    device = next(target.parameters()).device
    if device.type != "cuda":
        zlab._cuda_time = time.perf_counter  # its stats timer syncs CUDA; the lengths need no timer
    drafter = zlab.DFlashDraftModel.from_pretrained(str(export), dtype=target.dtype).to(device).eval()
    found = []
    for prompt in prompts:
        stats = zlab.dflash_generate(
            drafter,
            target,
            torch.tensor([prompt], device=device),
            max_new_tokens + 1,
            [eos_token_id] if eos_token_id is not None else None,
            temperature=0.0,
            return_stats=True,
        )
        found.append([int(n) for n in stats.acceptance_lengths])
    return found


def zlab_tau(run_dir: Path, export: Path, overrides: list[str] | tuple[str, ...] = ()) -> ZlabResult:
    """z-lab's loop on ``export`` over the eval prompts of ``run_dir``'s config (module docstring)."""
    from importlib.metadata import version

    from training.config import read_config
    from training.model.target import build_target
    from training.run import core

    config = read_config(run_dir, overrides)
    loaded = build_target(config)
    data = core.load_train_data(config, loaded.tokenizer, run_dir / core.DATA_CACHE, lambda _line: None)
    prompts = data.eval_prompts(config.eval.prompt_tokens, config.eval.num_prompts, config.eval.split)
    if not prompts:
        raise ValueError(f"z-lab eval: the run's data has no {config.eval.split} prompts")
    started = time.monotonic()
    lengths = zlab_lengths(
        export, loaded.model.eval(), prompts, config.eval.max_new_tokens, loaded.tokenizer.eos_token_id
    )
    return summarise(lengths, time.monotonic() - started, version("dflash"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--export", required=True, type=Path, help="the exported drafter folder")
    args, extra = parser.parse_known_args(argv)
    if other := [arg for arg in extra if not arg.startswith("--eval.")]:
        parser.error(f"unexpected argument {other[0]!r}: only --eval.KEY=VALUE overrides")
    result = zlab_tau(args.run_dir, args.export, extra)
    print(result.text(), file=sys.stderr)
    data: dict[str, Any] = asdict(result)
    print(json.dumps(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
