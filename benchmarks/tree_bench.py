"""DDTree on one GPU: what each tree budget costs and which one pays; the levers of the tree's tau.

    # the cost curve: the Qwen3.6-27B-shape hybrid (random bf16 weights built on the GPU: its tau is
    # meaningless, the cost curve and the tau each budget must reach are the point), and smol
    python benchmarks/tree_bench.py cost --config qwen3.6-27b-random [--context 96,1024,4096]
    python benchmarks/tree_bench.py cost --config smol-h200 [--run RUN_DIR | --taus 0=2.77,64=3.9]
    # the script itself on a CPU
    python benchmarks/tree_bench.py cost --config tiny-cpu --device cpu --budgets 0,16 --repeats 1

    # levers of the tree's tau, judged at the best budget on the held-out prompts, the chain beside
    python benchmarks/tree_bench.py levers calibrate --run RUN_DIR [--anchors 1024] [--save]
    python benchmarks/tree_bench.py levers train --out OUT [--config smol-h200] \
        --arm "base=" --arm "gamma14=--drafter.gamma=14" [--set=--train.steps=3000 ...]

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

``levers calibrate`` loads a run's newest checkpoint with its target (``python -m training eval``'s
set-up), fits one temperature per depth of the drafter's distributions on ``--anchors`` anchors of
its training rows (``training.run.tree_calibration``: the NLL of the target's greedy token), then
evaluates the held-out prompts' chain and tree taus at ``eval.tree_budgets`` without and with them
(``evaluate_acceptance(temperatures=...)``; the chain cannot change: a temperature keeps the
argmax). The verdict: the tree's tau at the best budget (the cost model's on a GPU, else the
highest tau) raised by >= 3% with the chain not lower by more than 0.02. ``--save`` writes the
temperatures, where they ship, to the run dir's ``tree-calibration.json``, which ``python -m
training export`` puts in ``ddtree.json``.

``levers train`` trains one run per ``--arm NAME=OVERRIDES`` (``python -m training train --config
CONFIG`` with the ``--set`` overrides and the arm's, in ``OUT/NAME``), evaluates each on the
held-out prompts (``python -m training eval``, ``--eval-set`` overrides, e.g. 64 prompts) and
reports each arm's chain and tree taus against the first arm's with the same verdict. The trainer's
levers of the loss: ``drafter.gamma``, its weighting across block positions (offset k weighs
exp(-(k-1)/gamma)), and ``drafter.label_smoothing``, the CE's label smoothing eps (the target
(1 - eps) * onehot + eps / V: probability kept on the alternatives beyond the top-1 that the tree
drafts; e.g. ``--arm "ls01=--drafter.label_smoothing=0.1"``); it has no entropy term.
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
    if meaningless:
        print(
            f"{config.name} has random weights: its tau means nothing; the figures are the cost curve and "
            "the tau each budget must reach (break-even)"
            + (", the speedups below only illustrate the given taus" if taus else "")
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


SHIP_GAIN = 0.03  # a lever ships when it raises the tree's tau at the best budget by 3% ...
CHAIN_SLACK = 0.02  # ... and lowers the chain's by no more than this


def verdict(base: Mapping[int, float], arm: Mapping[int, float], budget: int) -> dict[str, Any]:
    """Does ``arm`` (taus by budget, 0 = the chain) beat ``base`` at ``budget``: the tree's tau up by
    >= SHIP_GAIN, the chain down by <= CHAIN_SLACK."""
    gain = arm[budget] / base[budget] - 1.0
    chain_change = arm[0] - base[0]
    return {
        "budget": budget,
        "tree_gain": gain,
        "chain_change": chain_change,
        "ships": gain >= SHIP_GAIN and chain_change >= -CHAIN_SLACK,
    }


def verdict_line(judged: Mapping[str, Any]) -> str:
    return (
        f"at budget {judged['budget']}: tree tau {judged['tree_gain'] * 100:+.1f}%, "
        f"chain {judged['chain_change']:+.3f}: "
        + ("SHIPS" if judged["ships"] else "does not ship")
        + f" (>= {SHIP_GAIN * 100:.0f}% with the chain within {CHAIN_SLACK})"
    )


def taus_line(taus: Mapping[int, float]) -> str:
    """``chain 2.771  16 3.402  64 3.910``."""
    return "  ".join(f"{'chain' if b == 0 else b} {t:.3f}" for b, t in sorted(taus.items()))


def taus_of(result: Any) -> dict[int, float]:
    """An ``AcceptanceResult``'s taus per round by budget, the chain at 0."""
    return {0: result.tau_mean, **{t.budget: t.tau_mean for t in result.trees}}


def best_budget(taus: Mapping[int, float], cost: Any) -> int:
    """The budget the verdict is taken at: the cost model's best, else the highest tree tau."""
    best = cost.best(taus) if cost is not None else None
    if best is not None and best[0] > 0:
        return best[0]
    return max((b for b in taus if b > 0), key=lambda b: (taus[b], -b))


def training_batches(trainer: Any, device: Any) -> Any:
    """The run's training rows in its own order with its own anchors, on ``device``."""
    from training.data.buckets import Position
    from training.run import core

    position = Position()
    pad_id = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0
    while True:
        batch, after = trainer.data.batch(position, pad_id, pad_to_bucket=False)
        anchors = core.batch_anchors(trainer.config, batch.loss_mask, batch.lengths, batch.position)
        yield batch.input_ids.to(device), batch.loss_mask.to(device), anchors.to(device)
        if after.epoch > position.epoch:
            return
        position = after


def cmd_calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from training.config import read_config
    from training.contract import TREE_CALIBRATION_FILE
    from training.run.eval import evaluate_acceptance
    from training.run.single import Trainer
    from training.run.tree_calibration import (
        T_RANGE,
        depth_logits,
        fit_depth_temperatures,
        mean_nll,
        temperatures_text,
    )
    from training.run.tree_cost import eval_context, measure_tree_cost

    run_dir = args.run.resolve()
    config = read_config(run_dir, overrides)
    trainer = Trainer(config, run_dir, eval_only=True)
    try:
        trainer.setup(quiet_data=True)
        device = trainer.device
        started = time.perf_counter()
        logits, labels, valid = depth_logits(
            trainer.target, trainer.drafter, training_batches(trainer, device), args.anchors
        )
        temperatures = fit_depth_temperatures(logits, labels, valid)
        nll = [
            (mean_nll(logits[valid[:, d], d], labels[valid[:, d], d], 1.0),
             mean_nll(logits[valid[:, d], d], labels[valid[:, d], d], 1 / t))
            for d, t in enumerate(temperatures)
        ]  # fmt: skip
        anchors = int(logits.shape[0])
        del logits
        took = time.perf_counter() - started
        log(f"fitted on {anchors} anchors in {took:.1f}s: {temperatures_text(temperatures)}")
        if any(not T_RANGE[0] * 1.01 < t < T_RANGE[1] * 0.99 for t in temperatures):
            log(
                f"note: a temperature at the edge of the search range {T_RANGE}: the drafter is far off there"
            )
        cfg = config.eval
        prompts = trainer.data.eval_prompts(cfg.prompt_tokens, cfg.num_prompts, cfg.split)
        results = {}
        for name, temps in (("raw", None), ("calibrated", temperatures)):
            t0 = time.perf_counter()
            result = evaluate_acceptance(
                trainer.target,
                trainer.drafter,
                prompts,
                trainer.layer_ids,
                cfg.max_new_tokens,
                eos_token_id=trainer.tokenizer.eos_token_id,
                budgets=cfg.tree_budgets,
                tree_method=cfg.tree_method,
                temperatures=temps,
            )
            results[name] = taus_of(result)
            log(f"{name}: {results[name]} ({time.perf_counter() - t0:.1f}s, {len(prompts)} prompts)")
        cost = None
        if device.type == "cuda":
            budgets = sorted({0, *cfg.tree_budgets})
            cost = measure_tree_cost(trainer.target, trainer.drafter, eval_context(cfg), budgets)
        budget = best_budget(results["raw"], cost)
        judged = verdict(results["raw"], results["calibrated"], budget)
        step = trainer.step
    finally:
        trainer.close()
    for name, taus in results.items():
        print(
            f"{name:>10}: "
            + "  ".join(f"{'chain' if b == 0 else b} {t:.3f}" for b, t in sorted(taus.items()))
        )
    print(verdict_line(judged))
    body = {
        "run": str(run_dir),
        "step": step,
        "anchors": anchors,
        "temperatures": list(temperatures),
        "nll_per_depth": [{"raw": a, "calibrated": b} for a, b in nll],
        "prompts": len(prompts),
        "taus": {name: {str(b): t for b, t in sorted(taus.items())} for name, taus in results.items()},
        "cost": cost.to_json(results["raw"]) if cost is not None else None,
        "verdict": judged,
    }
    if args.save and not judged["ships"]:
        log(f"not saved: the temperatures do not help ({TREE_CALIBRATION_FILE} left as it was)")
    elif args.save:
        (run_dir / TREE_CALIBRATION_FILE).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
        log(f"wrote {run_dir / TREE_CALIBRATION_FILE}")
    out = Path(args.out or "tree-levers-calibrate.json")
    out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"temperatures": body["temperatures"], **judged}))
    return 0


def _arm(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or "/" in name:
        raise SystemExit(f"tree_bench: --arm {text!r}: give NAME=OVERRIDES (NAME= for the recipe as it is)")
    return name, rest.split()


def cmd_train_levers(args: argparse.Namespace) -> int:
    import subprocess

    from training.contract import EVENTS_FILE, parse_events, tree_figures

    arms = [_arm(a) for a in args.arm]
    if not arms:
        raise SystemExit(
            "tree_bench: levers train: give --arm NAME=OVERRIDES at least once (the first is the base)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    for name, extra in arms:
        run_dir = args.out / name
        train = [
            sys.executable,
            "-m",
            "training",
            "train",
            "--config",
            args.config,
            "--run-dir",
            str(run_dir),
        ]
        evaluate = [sys.executable, "-m", "training", "eval", "--run-dir", str(run_dir)]
        for argv in ([*train, *args.set, *extra], [*evaluate, *args.eval_set]):
            log(" ".join(argv))
            with open(run_dir.parent / f"{name}.log", "a", encoding="utf-8") as out:
                code = subprocess.run(
                    argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False
                ).returncode
            if code != 0:
                log(f"{name}: exit {code} (see {run_dir.parent / f'{name}.log'})")
                break
        events = (
            (run_dir / EVENTS_FILE).read_text(encoding="utf-8") if (run_dir / EVENTS_FILE).is_file() else ""
        )
        evals = [
            e
            for e in parse_events(events).events
            if e["event"] == "eval" and e.get("split", "held_out") == "held_out"
        ]
        figures = tree_figures(evals[-1]) if evals else None
        found[name] = figures
    base_name = arms[0][0]
    base = found[base_name]
    rows: dict[str, Any] = {}
    for name, figures in found.items():
        if figures is None:
            rows[name] = {"error": "no eval with tree figures"}
            continue
        row: dict[str, Any] = {
            "taus": {str(b): t for b, t in sorted(figures.taus.items())},
            "best_budget": figures.best_budget,
        }
        if base is not None and name != base_name:
            budget = base.best_budget if base.best_budget else max(b for b in base.taus if b > 0)
            if budget in figures.taus:
                row["verdict"] = verdict(base.taus, figures.taus, budget)
        rows[name] = row
        print(f"{name:>12}: {taus_line(figures.taus)}")
        if "verdict" in row:
            print(f"{'':>12}  {verdict_line(row['verdict'])}")
    (args.out / "levers.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


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
    levers = sub.add_parser("levers", help="levers of the tree's tau, one arm per call")
    arms = levers.add_subparsers(dest="lever", required=True)
    calibrate = arms.add_parser("calibrate", help="per-depth temperatures fitted on a run's training rows")
    calibrate.add_argument("--run", type=Path, required=True, help="a run dir with a checkpoint")
    calibrate.add_argument("--anchors", type=int, default=1024, help="anchors of training rows to fit on")
    calibrate.add_argument("--save", action="store_true", help="write the run dir's tree-calibration.json")
    calibrate.add_argument("--out", default="", help="the JSON (default tree-levers-calibrate.json)")
    train = arms.add_parser("train", help="one training run per --arm, each evaluated")
    train.add_argument("--out", type=Path, required=True, help="a folder: one run dir per arm")
    train.add_argument("--config", default="smol-h200")
    train.add_argument(
        "--arm", action="append", default=[], help="NAME=--section.key=value ... (first = base)"
    )
    train.add_argument("--set", action="append", default=[], help="an override for every arm's training")
    train.add_argument("--eval-set", action="append", default=[], help="an --eval.KEY=VALUE for every eval")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.command == "cost":
        return cmd_cost(args, overrides)
    if args.command == "levers" and args.lever == "calibrate":
        return cmd_calibrate(args, overrides)
    if args.command == "levers" and args.lever == "train":
        if overrides:
            raise SystemExit(f"tree_bench: levers train: unexpected {overrides[0]!r} (overrides go in --set)")
        return cmd_train_levers(args)
    raise SystemExit(f"tree_bench: unknown command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
