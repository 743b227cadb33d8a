"""Magpie as a data source (``data.regen_sources = "magpie"``, training.data.magpie), measured.

``rate``: the target writes ``--prompts`` requests from its user-turn prefix (SmolLM2-135M of
``--config``: smol-cpu on a CPU, smol-h200 on a GPU) through the trainer's own path (filters and
de-duplication included); prints one JSON line: requests kept and sampled, seconds, requests kept
and sampled per second, the share filtered out and each filter's count, a few kept requests.
Nothing is cached: the rate is measured each time.

``all``: one lever per arm on one GPU, each arm smol-h200 trained with its data overrides for
```--steps`` steps and its last checkpoint evaluated by fleet's evaluator (``python -m training eval
--export``) on the general set (``--general``: ``eval.sets``' shipped "general", or a file) and on
today's held-out file (``--heldout``: the quality benchmark's ``heldout.jsonl``, so the in-family
figure stays comparable with benchmarks/RESULTS.md). Arms (``--size`` prompts, ``2x``: twice as many):

- ``base``: today's sources, ``stdlib,packages`` (the control)
- ``magpie``: Magpie alone
- ``mix25`` / ``mix50``: today's sources with Magpie writing 25% / 50% of the prompts
- ``magpie-2x`` / ``mix50-2x``: the size lever of ``magpie`` and ``mix50``

Each arm's rows are regenerated through the trainer (``data.regenerate``, cached), the held-out
file's prompts removed from them (a prompt of the shipped corpus may be in both), and the rest
trained on (``data.path``, ``data.eval_path`` = the held-out file). Resumable per arm: an arm whose
evaluation is in ``OUT/results.json`` is skipped, a stopped one resumes from its checkpoint.
``report`` writes ``OUT/table.md`` from ``OUT/results.json``.

    python benchmarks/magpie_bench.py rate [--config smol-cpu] [--prompts 64] [--threads 2]
    python benchmarks/magpie_bench.py all --out OUT --heldout Q/heldout.jsonl [--size 3000]
        [--steps 2000] [--arms base,magpie,mix25,mix50,magpie-2x,mix50-2x] [--set --data.x=y]
    python benchmarks/magpie_bench.py report --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # quality_bench, whoever runs this file

CONFIG = "smol-h200"
TODAY = "stdlib,packages"
# name -> (sources, Magpie's share when mixed, size multiple)
ARMS: dict[str, tuple[str, float, int]] = {
    "base": (TODAY, 0.5, 1),
    "magpie": ("magpie", 0.5, 1),
    "mix25": (f"{TODAY},magpie", 0.25, 1),
    "mix50": (f"{TODAY},magpie", 0.5, 1),
    "magpie-2x": ("magpie", 0.5, 2),
    "mix50-2x": (f"{TODAY},magpie", 0.5, 2),
}


def quality_bench() -> Any:
    """benchmarks/quality_bench.py: its data helpers, trainer and evaluator runs (its ``EXTRA``
    overrides are this benchmark's ``--set``)."""
    import quality_bench

    return quality_bench


def log(text: str) -> None:
    print(f"[magpie {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- rate
def cmd_rate(args: argparse.Namespace) -> None:
    import torch

    from training.config import load_config
    from training.data.magpie import MagpieSettings, collect, sample_in_process, user_turn
    from training.model.target import load_model, load_tokenizer, model_source

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, args.set)
    folder, tok_dir = model_source(config)
    model, tokenizer = load_model(config, folder), load_tokenizer(tok_dir)
    settings = MagpieSettings.of(config.data)
    batch = args.batch or config.data.regen_batch_size
    turn = user_turn(tokenizer)
    draw = sample_in_process(model, tokenizer, turn, settings, batch)
    result = collect(draw, args.prompts, settings, turn.markers, batch, lambda kept: log(f"{kept} kept"))
    device = next(model.parameters()).device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    seconds = max(result.seconds, 1e-9)
    print(
        json.dumps(
            {
                "config": args.config,
                "device": where,
                "batch": batch,
                "settings": settings.__dict__,
                **result.to_json(),
                "kept_per_s": round(len(result.prompts) / seconds, 3),
                "sampled_per_s": round(result.sampled / seconds, 3),
                "loadavg_1m": round(os.getloadavg()[0], 2),
                "examples": list(result.prompts[:5]),
            }
        )
    )


# --------------------------------------------------------------------------------------------- arms
def arm_overrides(name: str, size: int) -> list[str]:
    sources, share, times = ARMS[name]
    return [
        f"--data.regen_prompts={size * times}",
        f"--data.regen_sources={sources}",
        f"--data.magpie_share={share}",
    ]


def magpie_report(overrides: list[str]) -> dict[str, Any] | None:
    """The Magpie set's report (kept, sampled, each filter's count) of an arm, if it has one."""
    from training.run.core import planned_magpie_file

    q = quality_bench()
    found = planned_magpie_file(q.fleet_config(overrides))
    report = found.with_suffix(".report.json") if found else None
    return json.loads(report.read_text()) if report and report.is_file() else None


def run_arm(args: argparse.Namespace, name: str) -> dict[str, Any]:
    q = quality_bench()
    q.CONFIG, q.EXTRA[:] = args.config, list(args.set)
    out: Path = args.out
    overrides = arm_overrides(name, args.size)
    started = time.time()
    rows = q.read_jsonl(q.regenerate(overrides))
    regen_s = time.time() - started
    held = {q.prompt_of(r) for r in q.read_jsonl(args.heldout)}
    train = [r for r in rows if q.prompt_of(r) not in held]
    train_file = out / f"train-{name}.jsonl"
    q.write_jsonl(train_file, train)
    log(f"{name}: {len(rows)} rows ({regen_s:.0f} s), {len(rows) - len(train)} held-out prompts removed")
    args.points, args.run_eval_prompts = 1, 0  # quality_bench's trainer run: one checkpoint at the end
    trained = q.train_fleet(args, name, train_file, overrides)
    # a resumed arm's steps were logged before this launch: its train_s is no time
    train_s = trained["train_s"] if (trained["train_s"] or 0) > 0 else None
    result: dict[str, Any] = {
        "arm": name,
        "overrides": overrides,
        "rows": len(rows),
        "trained_rows": len(train),
        "regen_s": round(regen_s, 1),
        "magpie": magpie_report(overrides),
        "train": {"exit_code": trained["exit_code"], "wall_s": trained["wall_s"], "train_s": train_s},
        "evals": evaluate(args, name) if trained["exit_code"] == 0 else None,
    }
    return result


def evaluate(args: argparse.Namespace, name: str) -> dict[str, Any] | None:
    """The arm's last checkpoint exported, then fleet's evaluator on the held-out file and the
    general set (one eval, one line per set)."""
    q = quality_bench()
    run_dir, folder = args.out / name, args.out / "exports" / name
    (args.out / "evals").mkdir(parents=True, exist_ok=True)
    export = [sys.executable, "-m", "training", "export", "--run-dir", str(run_dir), "--out", str(folder)]
    if q.run_logged(export, args.out / "evals" / f"export-{name}.log") != 0:
        log(f"{name}: export failed")
        return None
    sets = {"held_out": "held_out", "general": args.general} if args.general else {"held_out": "held_out"}
    argv = [sys.executable, "-m", "training", "eval", "--run-dir", str(run_dir), "--export", str(folder)]
    # --general "": the held-out file alone, for a trainer without eval.sets
    which = f"--eval.sets=held_out,{args.general}" if args.general else "--eval.split=held_out"
    argv += [which, f"--eval.num_prompts={args.eval_prompts}"]
    log_path = args.out / "evals" / f"{name}.log"
    code = q.run_logged(argv, log_path)
    lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("eval export")]
    found: dict[str, Any] = {"exit_code": code}
    for key, label in sets.items():
        line = next((ln for ln in lines if f"({label})" in ln), "")
        if line:
            found[key] = {
                "tau_mean": float(line.split("tau_mean=")[1].split()[0]),
                "tau_prompt_mean": float(line.split("per round, ")[1].split()[0]),
                "line": line,
            }
    log(
        f"{name}: eval exit {code}: "
        + ", ".join(f"{k} {v['tau_mean']}" for k, v in found.items() if k != "exit_code")
    )
    return found


def done(out: Path) -> dict[str, Any]:
    path = out / "results.json"
    return json.loads(path.read_text()).get("arms", {}) if path.is_file() else {}


def cmd_all(args: argparse.Namespace) -> None:
    q = quality_bench()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.heldout.is_file():
        raise SystemExit(f"--heldout {args.heldout}: no such file (the quality benchmark's heldout.jsonl)")
    # quality_bench's trainer runs read the held-out file at OUT/heldout.jsonl (data.eval_path)
    if args.heldout.resolve() != (args.out / "heldout.jsonl").resolve():
        q.write_jsonl(args.out / "heldout.jsonl", q.read_jsonl(args.heldout))
    args.heldout = args.out / "heldout.jsonl"
    for name in args.arms.split(","):
        if name not in ARMS:
            raise SystemExit(f"--arms: unknown arm {name!r}: one of {', '.join(ARMS)}")
    for name in args.arms.split(","):
        arms = done(args.out)
        if "held_out" in ((arms.get(name) or {}).get("evals") or {}):
            log(f"{name}: done before, skipped")
            continue
        try:
            arms[name] = run_arm(args, name)
        except Exception as exc:  # one failed arm must not lose the others' figures
            arms[name] = {"arm": name, "error": f"{type(exc).__name__}: {exc}"}
            log(f"{name}: failed: {arms[name]['error']}")
        q.save(args.out, "arms", arms)
    cmd_report(args)


def table(arms: dict[str, Any]) -> list[str]:
    lines = [
        "| arm | sources | prompts | Magpie kept / sampled (filtered) | rows trained | train s | "
        "tau held-out | tau general |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        if "error" in arm:
            lines.append(f"| {name} | failed: {arm['error'][:80]} | | | | | | |")
            continue
        over = dict(o.removeprefix("--data.").split("=", 1) for o in arm["overrides"])
        mp = arm.get("magpie")
        magpie = f"{mp['kept']} / {mp['sampled']} ({100 * mp['filtered_share']:.1f}%)" if mp else "-"
        evals = arm.get("evals") or {}
        taus = [f"{evals[k]['tau_mean']:.3f}" if k in evals else "-" for k in ("held_out", "general")]
        share = (
            f" ({over['magpie_share']} Magpie)"
            if "," in over["regen_sources"] and "magpie" in over["regen_sources"]
            else ""
        )
        train_s = (arm.get("train") or {}).get("train_s")
        lines.append(
            f"| {name} | {over['regen_sources']}{share} | {over['regen_prompts']} | {magpie} | "
            f"{arm['trained_rows']} | {train_s or 0:.0f} | {taus[0]} | {taus[1]} |"
        )
    return lines


def cmd_report(args: argparse.Namespace) -> None:
    lines = table(done(args.out))
    (args.out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    rate = sub.add_parser("rate")
    rate.add_argument("--config", default="smol-cpu")
    rate.add_argument("--prompts", type=int, default=64)
    rate.add_argument("--batch", type=int, default=0, help="default: the config's data.regen_batch_size")
    rate.add_argument("--threads", type=int, default=0)
    for step in ("all", "report"):
        p = sub.add_parser(step)
        p.add_argument("--out", type=Path, required=True)
        if step == "all":
            p.add_argument("--heldout", type=Path, required=True)
            p.add_argument(
                "--config", default=CONFIG, help="smol-cpu: the benchmark's own smoke run on a CPU"
            )
            p.add_argument(
                "--general",
                default="general",
                help="eval.sets' name of the general set, or a file; '': the held-out file alone",
            )
            p.add_argument("--size", type=int, default=3000)
            p.add_argument("--steps", type=int, default=2000)
            p.add_argument("--eval-prompts", type=int, default=64)
            p.add_argument("--arms", default=",".join(ARMS))
    for p in sub.choices.values():
        if p.prog.endswith(("rate", "all")):
            p.add_argument("--set", action="append", default=[], help="an override of every run: --set=--k=v")
    args = parser.parse_args(argv)
    {"rate": cmd_rate, "all": cmd_all, "report": cmd_report}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
