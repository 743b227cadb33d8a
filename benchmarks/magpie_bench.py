"""Magpie as a data source (``data.regen_sources = "magpie"``, training.data.magpie), measured.

``rate``: the target writes ``--prompts`` requests from its user-turn prefix (SmolLM2-135M of
``--config``: smol-cpu on a CPU, smol-h200 on a GPU) through the trainer's own path (filters and
de-duplication included); prints one JSON line: requests kept and sampled, seconds, requests kept
and sampled per second, the share filtered out and each filter's count, a few kept requests.
Nothing is cached: the rate is measured each time.

``all``: one lever per arm on one GPU. The rows come from pools the trainer's own path regenerates
once each (cached), all at once in processes of their own: today's sources (``stdlib,packages``)
at ``--size`` prompts (smol-h200's own rows at its 15,000: the same cache key), and Magpie's
requests in ``--shards`` shards (each its own ``data.magpie_seed``) with their greedy replies, as
many as the arms need. Each arm draws its rows from the pools (seeded), the held-out rows removed,
trains smol-h200 for ``--steps`` (its own warm-up, no eval inside) on them, and its last checkpoint
is evaluated by fleet's evaluator (``python -m training eval --export``) on the held-out rows
(``--heldout``, else ``--held-out`` rows drawn from today's pool, as the trainer's own split draws
them) and the general set (``--general``), with the DDTree budgets (``--budgets``; replay, no cost
curve: arms trained at once share the GPU). Arms (``--size`` prompts, ``2x``: twice as many):

- ``base``: today's sources (the control: smol-h200's recipe at ``--size 15000 --steps 3000``)
- ``magpie``: Magpie alone
- ``mix25`` / ``mix50``: today's sources with Magpie writing 25% / 50% of the prompts
- ``magpie-2x`` / ``mix50-2x``: the size lever of ``magpie`` and ``mix50``
- ``--lever NAME=--k=v,...``: the base arm's rows with trainer overrides (DDTree's training levers,
  e.g. ``gamma12=--drafter.gamma=12``), judged against ``base``

``--base-shards N`` regenerates today's pool in N slices at once instead (outside the trainer's
cache: the pool files stay in ``OUT``). ``--parallel N`` trains and evaluates N arms at once (a
135M target and its drafter leave one GPU mostly idle between their launches). Resumable per
arm: an arm whose evaluation is in ``OUT/results.json`` is skipped, a pool written before is read
back, a stopped arm resumes from its checkpoint. ``report`` writes ``OUT/table.md`` from ``OUT/results.json``.

    python benchmarks/magpie_bench.py rate [--config smol-cpu] [--prompts 64] [--threads 2]
    python benchmarks/magpie_bench.py all --out OUT [--heldout Q/heldout.jsonl] [--size 3000]
        [--steps 2000] [--arms base,magpie,mix25,mix50,magpie-2x,mix50-2x] [--lever NAME=OVERRIDES]
        [--budgets 16,64,256] [--shards 2] [--parallel 1] [--set --data.x=y]
    python benchmarks/magpie_bench.py report --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # quality_bench, whoever runs this file

CONFIG = "smol-h200"
ARMS_SAVED = threading.Lock()  # arms trained at once read, add to and save one results file
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
    """The data keys of ``name`` as one config (what the arm's rows are, if the trainer wrote them
    itself): the table reads an arm's sources, share and size from them."""
    sources, share, times = ARMS[name]
    return [
        f"--data.regen_prompts={size * times}",
        f"--data.regen_sources={sources}",
        f"--data.magpie_share={share}",
    ]


def arm_counts(name: str, size: int) -> tuple[int, int]:
    """(shipped-source rows, Magpie rows) of an arm: ``training.data.regen.source_counts``' split."""
    from training.data.regen import source_counts

    sources, share, times = ARMS[name]
    return source_counts(size * times, sources, share)


def pool_plan(arms: list[str], size: int, shards: int, base_shards: int = 1) -> dict[str, list[str]]:
    """The pools the arms draw from, each regenerated once, all at once in processes of their own
    (the generation of a 135M target is bound by its launches, not by the GPU): today's sources at
    as many prompts as the arms need, whole through the trainer's own path and cache (smol-h200's
    own rows at its 15,000: the same cache key) or in ``base_shards`` slices (``base-K``: every
    K-th prompt of that list, its greedy replies by the same function), and Magpie's requests in
    ``shards`` shards (``magpie-K``, each its own ``data.magpie_seed``) with their replies, through
    the trainer's path. Name -> the pool's overrides (a slice's: ``--slice=K/N`` first)."""
    need_base = max((arm_counts(a, size)[0] for a in arms), default=0)
    need_magpie = max((arm_counts(a, size)[1] for a in arms), default=0)
    plan: dict[str, list[str]] = {}
    if need_base:
        today = [f"--data.regen_prompts={need_base}", f"--data.regen_sources={TODAY}"]
        if base_shards <= 1:
            plan["base"] = today
        else:
            plan.update({f"base-{k}": [f"--slice={k}/{base_shards}", *today] for k in range(base_shards)})
    if need_magpie:
        each = -(-need_magpie // shards)
        for k in range(shards):
            plan[f"magpie-{k}"] = [
                f"--data.regen_prompts={each}",
                "--data.regen_sources=magpie",
                f"--data.magpie_seed={k}",
            ]
    return plan


def regenerate_slice(out: Path, name: str, overrides: list[str]) -> Path:
    """A slice of today's prompts (``--slice=K/N``: every N-th from the K-th) answered greedily by
    the target, as ``training.data.regen.regenerated_data`` answers and writes the whole list."""
    from training.data.regen import generate_completions, shipped_prompts
    from training.model.target import load_model, load_tokenizer, model_source

    which, *rest = overrides
    k, n = (int(x) for x in which.removeprefix("--slice=").split("/"))
    config = quality_bench().fleet_config(rest)
    data = config.data
    prompts = shipped_prompts(data.regen_prompts, data.regen_sources)[k::n]
    folder, tok_dir = model_source(config)
    model, tokenizer = load_model(config, folder), load_tokenizer(tok_dir)
    replies = generate_completions(
        model, tokenizer, prompts, data.regen_max_new_tokens, data.regen_batch_size
    )
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]}
        for p, r in zip(prompts, replies, strict=True)
    ]
    path = out / f"pool-{name}.jsonl"
    quality_bench().write_jsonl(path, rows)
    return path


def cmd_pool(args: argparse.Namespace) -> None:
    """One pool's regeneration (a process of ``all``): its file and report in ``OUT/pool-NAME.json``."""
    q = quality_bench()
    q.CONFIG, q.EXTRA[:] = args.config, list(args.set)
    overrides = json.loads(args.overrides)
    started = time.time()
    sliced = bool(overrides) and overrides[0].startswith("--slice=")
    path = regenerate_slice(args.out, args.name, overrides) if sliced else q.regenerate(overrides)
    body = {
        "path": str(path),
        "seconds": round(time.time() - started, 1),
        "magpie": None if sliced else magpie_report(overrides),
    }
    (args.out / f"pool-{args.name}.json").write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    log(f"pool {args.name}: {path} ({body['seconds']} s)")


def regenerate_pools(args: argparse.Namespace, plan: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Every pool at once, one process each (a pool done before is read back, not redone)."""
    from training.model.target import model_source

    # the config is valid before anything starts, and the GGUF converted once, not raced by the pools
    model_source(quality_bench().fleet_config([]))
    procs = {}
    for name, overrides in plan.items():
        if (args.out / f"pool-{name}.json").is_file():
            continue
        argv = [sys.executable, str(Path(__file__).resolve()), "pool", "--out", str(args.out)]
        argv += ["--name", name, "--config", args.config, "--overrides", json.dumps(overrides)]
        argv += [f"--set={o}" for o in args.set]
        log(f"pool {name}: {' '.join(overrides)}")
        with open(args.out / f"pool-{name}.log", "w") as out:
            procs[name] = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    failed = [name for name, proc in procs.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"pools {', '.join(failed)} failed: see {args.out}/pool-NAME.log")
    return {name: json.loads((args.out / f"pool-{name}.json").read_text()) for name in plan}


def pool_rows(pools: dict[str, dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(today's rows, Magpie's rows: the shards in order, exact repeats across shards dropped)."""
    q = quality_bench()
    base = [
        row
        for name in sorted(n for n in pools if n == "base" or n.startswith("base-"))
        for row in q.read_jsonl(Path(pools[name]["path"]))
    ]
    magpie: list[dict] = []
    seen: set[str] = set()
    for name in sorted(n for n in pools if n.startswith("magpie-")):
        for row in q.read_jsonl(Path(pools[name]["path"])):
            if (prompt := q.prompt_of(row)) not in seen:
                seen.add(prompt)
                magpie.append(row)
    return base, magpie


def arm_rows(name: str, size: int, base: list[dict], magpie: list[dict], seed: int) -> list[dict]:
    """An arm's rows drawn from the pools: its counts of each (a seeded draw where it takes part
    of a pool: today's pool lists the shipped corpus' prompts before the packages'), shuffled."""
    rng = random.Random(seed)
    n_base, n_magpie = arm_counts(name, size)
    if n_base > len(base) or n_magpie > len(magpie):
        raise SystemExit(
            f"arm {name}: needs {n_base} + {n_magpie} rows, the pools hold {len(base)} + {len(magpie)}"
        )
    rows = rng.sample(base, n_base) + rng.sample(magpie, n_magpie)
    rng.shuffle(rows)
    return rows


def parse_lever(text: str) -> tuple[str, list[str]]:
    """``NAME=--k=v,--k2=v2``: an arm on the ``base`` arm's rows with these trainer overrides."""
    name, sep, rest = text.partition("=")
    if not sep or not name or name in ARMS or "/" in name:
        raise SystemExit(f"--lever {text!r}: NAME=--section.key=value[,...] with a new NAME")
    return name, [o for o in rest.split(",") if o]


def magpie_report(overrides: list[str]) -> dict[str, Any] | None:
    """The Magpie set's report (kept, sampled, each filter's count) of a pool, if it has one."""
    from training.run.core import planned_magpie_file

    q = quality_bench()
    found = planned_magpie_file(q.fleet_config(overrides))
    report = found.with_suffix(".report.json") if found else None
    return json.loads(report.read_text()) if report and report.is_file() else None


def merged_magpie(pools: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The Magpie shards' reports summed (kept, sampled, the share filtered out)."""
    reports = [p["magpie"] for n, p in pools.items() if n.startswith("magpie-") and p.get("magpie")]
    if not reports:
        return None
    kept, sampled = sum(r["kept"] for r in reports), sum(r["sampled"] for r in reports)
    return {"kept": kept, "sampled": sampled, "filtered_share": round(1 - kept / max(sampled, 1), 4)}


def run_arm(args: argparse.Namespace, name: str, rows: list[dict], extra: list[str]) -> dict[str, Any]:
    q = quality_bench()
    out: Path = args.out
    held = {q.prompt_of(r) for r in q.read_jsonl(args.heldout)}
    train = [r for r in rows if q.prompt_of(r) not in held]
    train_file = out / f"train-{name}.jsonl"
    q.write_jsonl(train_file, train)
    log(f"{name}: {len(rows)} rows, {len(rows) - len(train)} held-out prompts removed")
    # quality_bench's trainer run: one checkpoint at the end, no eval inside
    run_args = argparse.Namespace(**{**vars(args), "points": 1, "run_eval_prompts": 0})
    # the config's own warm-up (quality_bench's runs take a tenth of the steps): the base arm is the recipe
    warmup = f"--train.warmup_steps={q.fleet_config([]).train.warmup_steps}"
    trained = q.train_fleet(run_args, name, train_file, [warmup, *extra])
    # a resumed arm's steps were logged before this launch: its train_s is no time
    train_s = trained["train_s"] if (trained["train_s"] or 0) > 0 else None
    return {
        "arm": name,
        "overrides": extra,
        "rows": len(rows),
        "trained_rows": len(train),
        "train": {"exit_code": trained["exit_code"], "wall_s": trained["wall_s"], "train_s": train_s},
        "evals": evaluate(args, name) if trained["exit_code"] == 0 else None,
    }


def evaluate(args: argparse.Namespace, name: str) -> dict[str, Any] | None:
    """The arm's last checkpoint exported, then fleet's evaluator on the held-out file and the
    general set (one eval, one line per set), the DDTree budgets with them (replay). No cost
    curve: the arms share the GPU, so their times would be each other's."""
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
    argv += [which, f"--eval.num_prompts={args.eval_prompts}", "--eval.tree_cost=off"]
    argv += [f"--eval.tree_budgets={args.budgets}"] if args.budgets else []
    log_path = args.out / "evals" / f"{name}.log"
    code = q.run_logged(argv, log_path)
    found: dict[str, Any] = {"exit_code": code, **eval_figures(log_path.read_text(), list(sets.values()))}
    log(
        f"{name}: eval exit {code}: "
        + ", ".join(f"{k} {v['tau_mean']}" for k, v in found.items() if k != "exit_code")
    )
    return found


def eval_figures(text: str, labels: list[str]) -> dict[str, Any]:
    """Each set's figures from ``python -m training eval --export``'s output: its line
    (``eval export FOLDER (SET): tau_mean=T per round, P per prompt ...``) and the table after it
    (``budget tau tau/prompt x chain tree size``, a row per budget, ``chain`` first)."""
    found: dict[str, Any] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if line.startswith("eval export"):
            label = next((x for x in labels if f"({x})" in line), None)
            current = None
            if label is not None and "tau_mean=" in line:
                current = found[label] = {
                    "tau_mean": float(line.split("tau_mean=")[1].split()[0]),
                    "tau_prompt_mean": float(line.split("per round, ")[1].split()[0]),
                    "tree": {},
                    "line": line,
                }
            continue
        cells = line.split()
        if current is not None and len(cells) >= 3 and (cells[0] == "chain" or cells[0].isdigit()):
            try:
                tau = float(cells[1])
            except ValueError:
                continue
            if cells[0] != "chain":
                current["tree"][cells[0]] = tau
    return found


def done(out: Path) -> dict[str, Any]:
    path = out / "results.json"
    return json.loads(path.read_text()).get("arms", {}) if path.is_file() else {}


def cmd_all(args: argparse.Namespace) -> None:
    q = quality_bench()
    q.CONFIG, q.EXTRA[:] = args.config, list(args.set)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.arms.split(",") if args.arms else []
    for name in names:
        if name not in ARMS:
            raise SystemExit(f"--arms: unknown arm {name!r}: one of {', '.join(ARMS)}")
    levers = dict(parse_lever(text) for text in args.lever)
    if levers and "base" not in names:
        names.insert(0, "base")  # a lever trains on the base arm's rows and is judged against it
    later = [n for n in args.pools_for.split(",") if n]  # pools regenerated now, their arms trained later
    for name in later:
        if name not in ARMS:
            raise SystemExit(f"--pools-for: unknown arm {name!r}: one of {', '.join(ARMS)}")
    pools = regenerate_pools(args, pool_plan(names + later, args.size, args.shards, args.base_shards))
    base, magpie = pool_rows(pools)
    q.save(args.out, "pools", {**pools, "magpie_total": merged_magpie(pools)})
    heldout = args.out / "heldout.jsonl"
    if args.heldout is not None:
        if not args.heldout.is_file():
            raise SystemExit(f"--heldout {args.heldout}: no such file (a JSONL of held-out rows)")
        if args.heldout.resolve() != heldout.resolve():
            q.write_jsonl(heldout, q.read_jsonl(args.heldout))
    elif not heldout.is_file():  # today's rows' own held-out draw, as the trainer's split does it
        held, _rest = q.split_rows(base, args.held_out, args.seed)
        q.write_jsonl(heldout, held)
    args.heldout = heldout  # quality_bench's trainer runs read it there (data.eval_path)
    jobs = [(n, arm_rows(n, args.size, base, magpie, args.seed), []) for n in names]
    base_rows = next((rows for n, rows, _ in jobs if n == "base"), [])
    jobs += [(n, base_rows, over) for n, over in levers.items()]

    def one(job: tuple[str, list[dict], list[str]]) -> None:
        name, rows, extra = job
        if "held_out" in ((done(args.out).get(name) or {}).get("evals") or {}):
            log(f"{name}: done before, skipped")
            return
        try:
            result = run_arm(args, name, rows, extra)
        except Exception as exc:  # one failed arm must not lose the others' figures
            result = {"arm": name, "error": f"{type(exc).__name__}: {exc}"}
            log(f"{name}: failed: {result['error']}")
        with ARMS_SAVED:
            arms = done(args.out)
            arms[name] = result
            q.save(args.out, "arms", arms)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        list(pool.map(one, jobs))
    cmd_report(args)


def table(arms: dict[str, Any], size: int) -> list[str]:
    """One row per arm: its rows (today's + Magpie's), its overrides, training seconds, the chain's
    tau on both sets and the tree's on the held-out prompts at each budget measured."""
    budgets = sorted(
        {
            int(b)
            for a in arms.values()
            for b in (((a.get("evals") or {}).get("held_out") or {}).get("tree") or {})
        }
    )
    lines = [
        "| arm | rows: today's + Magpie | overrides | rows trained | train s | tau held-out | tau general | "
        + " | ".join(f"tree {b} held-out" for b in budgets)
        + (" |" if budgets else "|"),
        "|---|---|---|---|---|---|---|" + "---|" * len(budgets),
    ]
    for name, arm in arms.items():
        if "error" in arm:
            lines.append(f"| {name} | failed: {arm['error'][:80]} | | | | | |" + " |" * len(budgets))
            continue
        counts = arm_counts(name if name in ARMS else "base", size)
        evals = arm.get("evals") or {}
        taus = [f"{evals[k]['tau_mean']:.3f}" if k in evals else "-" for k in ("held_out", "general")]
        tree = (evals.get("held_out") or {}).get("tree") or {}
        trees = [f"{tree[str(b)]:.3f}" if str(b) in tree else "-" for b in budgets]
        train_s = (arm.get("train") or {}).get("train_s")
        over = " ".join(arm.get("overrides") or []) or "-"
        lines.append(
            f"| {name} | {counts[0]} + {counts[1]} | {over} | {arm['trained_rows']} | {train_s or 0:.0f} | "
            + " | ".join([*taus, *trees])
            + " |"
        )
    return lines


def cmd_report(args: argparse.Namespace) -> None:
    lines = table(done(args.out), args.size)
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
    pool = sub.add_parser("pool")  # one pool's regeneration: a process of `all`
    pool.add_argument("--out", type=Path, required=True)
    pool.add_argument("--name", required=True)
    pool.add_argument("--config", default=CONFIG)
    pool.add_argument("--overrides", required=True, help="a JSON list of the pool's data overrides")
    for step in ("all", "report"):
        p = sub.add_parser(step)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--size", type=int, default=3000)
        if step == "all":
            p.add_argument(
                "--heldout",
                type=Path,
                default=None,
                help="the held-out rows (JSONL); default: --held-out rows drawn from today's pool",
            )
            p.add_argument("--held-out", type=int, default=64)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument(
                "--config", default=CONFIG, help="smol-cpu: the benchmark's own smoke run on a CPU"
            )
            p.add_argument(
                "--general",
                default="general",
                help="eval.sets' name of the general set, or a file; '': the held-out file alone",
            )
            p.add_argument("--steps", type=int, default=2000)
            p.add_argument("--eval-prompts", type=int, default=64)
            p.add_argument("--arms", default=",".join(ARMS))
            p.add_argument(
                "--lever",
                action="append",
                default=[],
                help="NAME=--k=v[,--k2=v2]: an arm on the base arm's rows with these trainer overrides",
            )
            p.add_argument(
                "--budgets", default="", help="eval.tree_budgets of the evals (default: the config's)"
            )
            p.add_argument("--shards", type=int, default=2, help="Magpie's pool in this many processes")
            p.add_argument("--base-shards", type=int, default=1, help="today's pool in this many processes")
            p.add_argument("--parallel", type=int, default=1, help="arms trained and evaluated at once")
            p.add_argument(
                "--pools-for",
                default="",
                help="ARM,...: their pools regenerated now too, the arms not trained (a later run's)",
            )
    for p in sub.choices.values():
        if p.prog.endswith(("rate", "all", "pool")):
            p.add_argument("--set", action="append", default=[], help="an override of every run: --set=--k=v")
    args = parser.parse_args(argv)
    {"rate": cmd_rate, "pool": cmd_pool, "all": cmd_all, "report": cmd_report}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
