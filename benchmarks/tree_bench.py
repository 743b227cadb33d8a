"""DDTree on one GPU: what each tree budget costs and which one pays; the levers of the tree's tau.

    # the cost curve: the Qwen3.6-27B-shape hybrid (random bf16 weights built on the GPU: its tau is
    # meaningless, the cost curve and the tau each budget must reach are the point), and smol
    python benchmarks/tree_bench.py cost --config qwen3.6-27b-random [--context 96,1024,4096]
    python benchmarks/tree_bench.py cost --config smol-h200 [--run RUN_DIR | --taus 0=2.77,64=3.9]
    # the script itself on a CPU
    python benchmarks/tree_bench.py cost --config tiny-cpu --device cpu --budgets 0,16 --repeats 1

``cost`` builds the config's target and an untrained drafter of its [drafter] shape on one device
and times a round's parts at each context (``training.run.tree_cost.measure_tree_cost``: the
verify of 1+B tokens under the tree mask, the chain's verify at budget 0, the drafter's proposal,
the target's decode step; median of ``--repeats`` after ``--warmup``). The weights do not change
the times (the tree's shape does not change the mask's cost). Default context: the eval's
(``eval.prompt_tokens + eval.max_new_tokens // 2``). With taus (``--taus B=TAU,...`` with 0 = the
chain, or ``--run RUN_DIR``: its last held-out ``eval`` event's ``tree`` figures), the modelled
speedup per budget and the best budget; always, each budget's break-even tau (speedup 1 against
the target alone) and the tau ratio over the chain it needs to beat the chain. One JSON
(``--out``) and the tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_taus(text: str) -> dict[int, float]:
    """``0=2.77,64=3.9`` -> {0: 2.77, 64: 3.9} (0 = the chain)."""
    taus: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        budget, sep, tau = part.partition("=")
        try:
            taus[int(budget)] = float(tau)
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"tree_bench: --taus {text!r}: give BUDGET=TAU pairs, e.g. 0=2.77,64=3.9")
    return taus


def run_taus(run_dir: Path) -> dict[int, float]:
    """The taus of a run's last held-out ``eval`` event: its chain (0) and tree budgets."""
    from training.contract import EVENTS_FILE, parse_events, tree_figures

    path = run_dir / EVENTS_FILE
    if not path.is_file():
        raise SystemExit(f"tree_bench: --run {run_dir}: no {EVENTS_FILE} there")
    evals = [
        ev
        for ev in parse_events(path.read_text(encoding="utf-8")).events
        if ev["event"] == "eval" and ev.get("split", "held_out") == "held_out"
    ]
    figures = tree_figures(evals[-1]) if evals else None
    if figures is None:
        raise SystemExit(
            f"tree_bench: --run {run_dir}: no held-out eval with tree figures yet (`python -m training eval`)"
        )
    return figures.taus


def beat_chain(cost: Any) -> dict[int, float]:
    """Per budget, the tau ratio over the chain's at which its modelled speedup equals the chain's."""
    chain = cost.t_verify_s.get(0)
    if chain is None:
        return {}
    return {b: cost.round_s(b) / cost.round_s(0) for b in sorted(cost.t_verify_s)}


def cmd_cost(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from training.config import load_config
    from training.model import kernels
    from training.model.target import load_model, load_tokenizer, model_source
    from training.run import core
    from training.run.tree_cost import eval_context, is_hybrid, measure_tree_cost

    config = load_config(args.config, [*overrides, f"--model.device={args.device}"])
    budgets = (
        tuple(int(b) for b in args.budgets.split(",")) if args.budgets else config.eval.tree_cost_budgets
    )
    contexts = [int(c) for c in args.context.split(",")] if args.context else [eval_context(config.eval)]
    taus = parse_taus(args.taus) if args.taus else run_taus(args.run) if args.run else {}
    started = time.perf_counter()
    folder, tok_dir = model_source(config)
    tokenizer = load_tokenizer(tok_dir)
    target = load_model(config, folder)
    device = torch.device(args.device)
    drafter = core.build_drafter(config, target, device, tokenizer)
    log(f"built {config.name} ({config.model.kind}) and its drafter in {time.perf_counter() - started:.1f}s")
    hybrid = is_hybrid(target)
    if hybrid:
        log(kernels.linear_attention_kernels(target).line())
    meaningless = config.model.kind == "random"
    if meaningless and taus:
        log(
            "note: a random-weight target's tau means nothing: "
            "the speedups below only illustrate the given taus"
        )
    results: list[dict[str, Any]] = []
    for context in contexts:
        t0 = time.perf_counter()
        cost = measure_tree_cost(
            target, drafter, context, budgets, repeats=args.repeats, warmup=args.warmup, seed=args.seed
        )
        log(f"context {context}: measured in {time.perf_counter() - t0:.1f}s")
        print(cost.table(taus))
        ratios = beat_chain(cost)
        print(
            "break-even tau (speedup 1 vs the target alone): "
            + ", ".join(f"{'chain' if b == 0 else b} {t:.2f}" for b, t in cost.break_even().items())
        )
        if ratios:
            print(
                "tau over the chain's needed to beat the chain: "
                + ", ".join(f"{b} {r:.2f}x" for b, r in ratios.items() if b)
            )
        view = cost.to_json(taus or None)
        view["beat_chain_ratio"] = {str(b): r for b, r in ratios.items()}
        results.append(view)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    body = {
        "config": config.name,
        "model_kind": config.model.kind,
        "hybrid": hybrid,
        "tau_meaningful": not meaningless,
        "taus": {str(b): t for b, t in sorted(taus.items())},
        "budgets": list(budgets),
        "costs": results,
    }
    out = Path(args.out or f"tree-cost-{config.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {out}")
    print(json.dumps({k: body[k] for k in ("config", "hybrid", "tau_meaningful")} | _best_line(results)))
    return 0


def _best_line(results: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {f"best_at_{r['context']}": [r.get("best_budget"), r.get("best_speedup")] for r in results}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cost = sub.add_parser("cost", help="time a round's parts per budget; modelled speedup and best budget")
    cost.add_argument("--config", default="qwen3.6-27b-random")
    cost.add_argument("--device", default="cuda")
    cost.add_argument("--context", default="", help="comma-separated KV-cache lengths (default: the eval's)")
    cost.add_argument(
        "--budgets", default="", help="comma-separated, 0 = the chain (default: eval.tree_cost_budgets)"
    )
    cost.add_argument("--repeats", type=int, default=10)
    cost.add_argument("--warmup", type=int, default=3)
    cost.add_argument("--seed", type=int, default=0)
    cost.add_argument("--taus", default="", help="BUDGET=TAU,... (0 = the chain) for the modelled speedups")
    cost.add_argument("--run", type=Path, default=None, help="take the taus from this run dir's last eval")
    cost.add_argument("--out", default="", help="the JSON (default tree-cost-CONFIG.json)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.command == "cost":
        return cmd_cost(args, overrides)
    raise SystemExit(f"tree_bench: unknown command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
