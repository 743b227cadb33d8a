"""Drafter quality side by side: fleet's trainer against SpecForge 0.2.0's, then levers of fleet's
recipe, each arm evaluated by one evaluator on one held-out set.

Every arm trains the reference drafter shape (``REFERENCE_SHAPE`` on smol-h200: SmolLM2-135M-Instruct
target, 4 layers, block 16, 5 target layers, 128 anchors per row, 3 sliding layers + 1 full) for the
same steps:

- ``data``: the target regenerates the rows (fleet's own regeneration, ``training.data.regen``);
  ``--held-out`` of them (a seeded draw) are written to ``heldout.jsonl``, the rest to
  ``train.jsonl``. Every arm trains on its train file and is evaluated on ``heldout.jsonl``
  (``data.eval_path``), so the arms share one held-out set.
- ``fleet``: ``python -m training train --config smol-h200`` on ``train.jsonl``, checkpoints at
  ``--points`` steps.
- ``features``: SpecForge's offline feature files of the same rows, tokenized by fleet's data path
  (the rows ``TrainData`` trains on) and run through the same target forward fleet uses
  (``training.model.target.target_forward``): ``input_ids`` Long[T], ``loss_mask`` [T],
  ``hidden_states`` bf16 [1, T, 5 x 576], one ``torch.save`` per sample (the format
  ``specforge/runtime/data_plane/offline_reader.py`` reads; shared/context/specforge-smol). Rows
  without two consecutive labelled tokens are left out, as SpecForge's loader would refuse them.
- ``specforge``: ``python -m specforge.cli train -c specforge.yaml`` (offline, ``local_colocated``,
  one process; SpecForge 0.2.0 installed ``--no-deps``), its draft config written from fleet's
  export config of the same drafter (so the shapes are equal by construction), then
  ``specforge export --to hf`` of each saved step. ``--specforge-seeds 0,1,2``: one SpecForge arm per
  seed (``specforge``, ``specforge-s1``, ...) on the same features; fleet's seeds are levers
  (``--lever "seed1=base --train.seed=1 --data.seed=1"``), so both trainers' run-to-run spread is
  measured beside the gap between them.
- levers (``--lever "NAME=DATA[@STEPS] --section.key=value ..."``): fleet again with one change of
  its recipe, on ``base`` (``train.jsonl``) or ``packages`` data (``train.jsonl`` + rows regenerated
  from prompts of the env's own packages, ``data.regen_sources = "stdlib,packages"``, minus any
  held-out prompt), for the benchmark's steps or STEPS.
- ``eval``: every arm's checkpoints exported to HF folders (fleet: ``python -m training export``)
  and evaluated by fleet's evaluator (``python -m training eval --export``: greedy verification by
  the target, acceptance per round) on the held-out prompts, in parallel processes; the
  memorisation check evaluates fleet's last checkpoint on ``--diag-prompts`` training prompts and
  as many held-out ones (``--eval.sets=train``). Where the ``dflash`` package is installed, each
  export is also decoded by z-lab's own loop on the same held-out prompts (benchmarks/zlab_eval.py:
  the second, independent evaluator; its figure beside fleet's in the report).
- ``report``: ``results.json``, a plot of tau against steps and against training seconds, and
  the markdown rows for benchmarks/RESULTS.md.
- ``pairs``: the seed pairs of several runs kept side by side (``OUT/<run>/results.json``, one
  device call per seed's pair) in one table, with the mean gap over them, its standard error and
  its one-sided 95% lower bound, and whether every run had the same rows (``data``'s sha256 of the
  train and held-out files, recorded in each results.json).

    python benchmarks/quality_bench.py all --out OUT [--steps 800 --points 4 --arms fleet,specforge]
        [--lever "opt=base --train.beta2=0.999" --lever "data=packages" ...] [--concurrent]

``--concurrent`` trains the arms at once (the tau figures do not depend on it; the training seconds
then do: take them from a run without it).

Each step also runs alone (``python benchmarks/quality_bench.py STEP --out OUT``); a failed arm is
recorded and the next one runs. One H200: ``benchmarks/gpu/quality.sh``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.contract import CHECKPOINT_DIR, CHECKPOINT_FORMAT, EVENTS_FILE  # noqa: E402

CONFIG = "smol-h200"  # --config: another (smol-cpu: the benchmark's own smoke run on a CPU)
SPECFORGE_RUN_ID = "smol-dflash-offline"


def log(text: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {text}", flush=True)


def points(steps: int, count: int) -> list[int]:
    """The steps whose checkpoints are evaluated: ``count`` evenly spaced, the last = ``steps``."""
    return sorted({max(1, steps * (i + 1) // count) for i in range(count)})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def prompt_of(record: dict[str, Any]) -> str:
    return str(record["messages"][0]["content"])


def split_rows(rows: list[dict[str, Any]], held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held-out, train): ``held_out`` rows drawn with ``seed``, both in the file's order."""
    chosen = set(random.Random(seed).sample(range(len(rows)), min(held_out, len(rows) - 1)))
    return [r for i, r in enumerate(rows) if i in chosen], [r for i, r in enumerate(rows) if i not in chosen]


# --------------------------------------------------------------------------------------------- data
def fleet_config(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    from training.config import load_config

    return load_config(CONFIG, [*EXTRA, *overrides])


EXTRA: list[str] = []  # --set: overrides of every arm's config (and of the regeneration)
# The drafter every arm trains on smol-h200: the shape shared/context/specforge-smol gives SpecForge
# (3 sliding layers over 512 tokens + 1 full), and the rows of the benchmark's first runs (greedy
# replies to the shipped corpus' ~3,000 prompts), pinned here because smol-h200's own recipe moved on
# (six full-attention layers, replies to 15,000 prompts: what this benchmark measured); a lever
# changes them for its arm alone.
REFERENCE_SHAPE = [
    "--drafter.num_layers=4",
    "--drafter.full_attention_layers=[3]",
    "--drafter.sliding_window=512",
    "--data.regen_prompts=3000",
    "--data.regen_sources=stdlib",
    "--data.regen_batch_size=256",
]


def reference_overrides(config: str) -> list[str]:
    """What every arm's config gets first: the reference shape and rows on smol-h200, nothing elsewhere."""
    return list(REFERENCE_SHAPE) if config == "smol-h200" else []


def regenerate(overrides: list[str]) -> Path:
    """The regenerated rows of smol-h200 (+ overrides), through fleet's own path (cached)."""
    from training.model.target import load_tokenizer, model_source
    from training.run.core import regenerate_data

    config = fleet_config(overrides)
    _folder, tok_dir = model_source(config)
    return regenerate_data(config, load_tokenizer(tok_dir), echo=log)


def cmd_data(args: argparse.Namespace) -> None:
    from training.run.checkpoint import file_digest  # torch: not for the steps that only read results

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(regenerate([]))
    held, train = split_rows(rows, args.held_out, args.seed)
    write_jsonl(out / "heldout.jsonl", held)
    write_jsonl(out / "train.jsonl", train)
    save(out, "data", {name: file_digest(out / name)[1] for name in SPLIT_FILES})
    log(f"data: {len(rows)} rows: {len(held)} held out, {len(train)} to train on")


SPLIT_FILES = ("train.jsonl", "heldout.jsonl")


def data_line(runs: dict[str, dict[str, Any]]) -> str:
    """Whether the runs set side by side trained and evaluated on the same bytes: the target
    regenerates the rows in each device call (greedy, so the same prompts give the same replies on
    one GPU, not necessarily on another), and pairs on other rows are not the same comparison."""
    known = {name: run["data"] for name, run in sorted(runs.items()) if run.get("data")}
    unknown = ", ".join(name for name in sorted(runs) if name not in known)
    if not known:
        return f"data: no sha256 recorded in {unknown}"
    first = next(iter(known.values()))
    if any(digest != first for digest in known.values()):
        each = ", ".join(f"{n} {d['train.jsonl'][:12]}/{d['heldout.jsonl'][:12]}" for n, d in known.items())
        return f"data: NOT the same in every run (train/held-out sha256: {each}): pair runs of one data set"
    line = f"data: identical in {len(known)} run{'s' * (len(known) != 1)}"
    line += f" (sha256 train {first['train.jsonl'][:16]}, held-out {first['heldout.jsonl'][:16]})"
    return line + (f"; not recorded in {unknown}" if unknown else "")


def packages_regen(args: argparse.Namespace) -> list[str]:
    return [
        f"--data.regen_prompts={args.packages_prompts}",
        "--data.regen_sources=stdlib,packages",
        f"--data.regen_batch_size={args.regen_batch}",
    ]


def cmd_packages_regen(args: argparse.Namespace) -> None:
    """Only the packages rows' regeneration (into the cache): ``all --concurrent`` runs it in a
    process of its own beside the base rows' from the start."""
    regenerate(packages_regen(args))


def start_packages_regen(args: argparse.Namespace) -> subprocess.Popen:
    argv = [sys.executable, str(Path(__file__).resolve()), "packages-regen", "--out", str(args.out)]
    argv += ["--config", CONFIG, f"--packages-prompts={args.packages_prompts}"]
    # args.set, not EXTRA: the child adds the reference shape itself
    argv += [f"--regen-batch={args.regen_batch}", *(f"--set={o}" for o in args.set)]
    log(f"packages rows regenerated beside: {' '.join(argv[1:])}")
    with open(args.out / "packages-regen.log", "w") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def cmd_packages_data(args: argparse.Namespace) -> None:
    """The packages lever's rows: train.jsonl + rows regenerated from the env's packages' prompts
    (``data.regen_sources = "stdlib,packages"``), none of them a held-out prompt."""
    base = read_jsonl(regenerate([]))
    held = {prompt_of(r) for r in read_jsonl(args.out / "heldout.jsonl")}
    seen = {prompt_of(r) for r in base}
    extra_rows = read_jsonl(regenerate(packages_regen(args)))
    extra = [r for r in extra_rows if prompt_of(r) not in seen and prompt_of(r) not in held]
    write_jsonl(args.out / "train_packages.jsonl", read_jsonl(args.out / "train.jsonl") + extra)
    log(f"data: packages lever: {len(base) - len(held)} + {len(extra)} rows (none of them held out)")


# -------------------------------------------------------------------------------------------- fleet
def fleet_overrides(args: argparse.Namespace, train_file: Path) -> list[str]:
    every = points(args.steps, args.points)[0]
    return [
        f"--data.path={train_file}",
        f"--data.eval_path={args.out / 'heldout.jsonl'}",
        f"--train.steps={args.steps}",
        f"--train.warmup_steps={max(1, args.steps // 10)}",
        f"--checkpoint.every={every}",
        f"--checkpoint.keep={args.points + 1}",
        "--eval.every=0",
        # the run's own end-of-run check (0: none); the arms' figures come from `eval`
        f"--eval.num_prompts={args.run_eval_prompts}",
    ]


def train_fleet(args: argparse.Namespace, name: str, train_file: Path, extra: list[str] = ()) -> dict:
    run_dir = args.out / name
    argv = [sys.executable, "-m", "training", "train", "--config", CONFIG, "--run-dir", str(run_dir)]
    argv += EXTRA + fleet_overrides(args, train_file) + list(extra)
    log(f"{name}: {' '.join(argv[1:])}")
    started = time.time()
    with open(args.out / f"{name}.log", "w") as out:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    events = read_jsonl(run_dir / EVENTS_FILE) if (run_dir / EVENTS_FILE).is_file() else []
    steps = [e for e in events if e.get("event") == "step"]
    trained = (steps[-1]["ts"] - started) if steps else None
    result = {
        "arm": name,
        "argv": argv[1:],
        "exit_code": code,
        "wall_s": time.time() - started,
        "train_s": trained,
        "steps": args.steps,
        # seconds from the launch to each logged step: where the curve against time puts a checkpoint
        "at_step": {str(e["step"]): e["ts"] - started for e in steps},
    }
    log(f"{name}: exit {code}, training {trained or 0:.1f} s of {result['wall_s']:.1f} s")
    return result


def cmd_fleet(args: argparse.Namespace) -> None:
    save(args.out, "fleet", train_fleet(args, "fleet", args.out / "train.jsonl"))


DATA_FILES = {"base": "train.jsonl", "packages": "train_packages.jsonl"}


@dataclass(frozen=True)
class Lever:
    """One arm of fleet with one change: ``NAME=DATA[@STEPS] --section.key=value ...``."""

    name: str
    data: str
    steps: int | None
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Lever:
        head, *overrides = shlex.split(text)
        name, _, spec = head.partition("=")
        data, _, steps = (spec or "base").partition("@")
        if (
            not name.isidentifier()
            or name == "fleet"
            or name.startswith("specforge")
            or data not in DATA_FILES
        ):
            raise SystemExit(f"--lever {text!r}: NAME=DATA[@STEPS] with DATA one of {sorted(DATA_FILES)}")
        if any(not o.startswith("--") or "=" not in o for o in overrides):
            raise SystemExit(f"--lever {text!r}: overrides are --section.key=value")
        return cls(name, data, int(steps) if steps else None, tuple(overrides))


def train_lever(args: argparse.Namespace, lever: Lever) -> None:
    run = argparse.Namespace(**{**vars(args), "steps": lever.steps or args.steps})
    result = train_fleet(run, lever.name, args.out / DATA_FILES[lever.data], list(lever.overrides))
    save(args.out, lever.name, {**result, "lever": {"data": lever.data, "overrides": list(lever.overrides)}})


def cmd_levers(args: argparse.Namespace) -> None:
    for lever in args.levers:
        train_lever(args, lever)


def arm_steps(args: argparse.Namespace, arm: str) -> int:
    lever = next((lv for lv in args.levers if lv.name == arm), None)
    return (lever.steps if lever else None) or args.steps


# ---------------------------------------------------------------------------------------- specforge
def feature_record(input_ids: Any, loss_mask: Any, hidden: Any) -> dict[str, Any] | None:
    """One SpecForge offline sample; None when it has no two consecutive labelled tokens."""
    import torch

    mask = loss_mask.to(torch.long)
    if not bool((mask[1:] * mask[:-1]).any()):
        return None
    return {
        "input_ids": input_ids.to(torch.long),
        "loss_mask": mask,
        "hidden_states": hidden.to(torch.bfloat16),
    }


def write_features(rows: Any, out: Path, target: Any, layer_ids: list[int]) -> int:
    """SpecForge's offline files of ``rows`` (``input_ids``, ``loss_mask`` columns) under ``out``."""
    import torch

    from training.model.target import target_forward

    out.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    written = 0
    for index, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
        input_ids = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            hidden = target_forward(target, input_ids[None].to(device), layer_ids).cpu()
        record = feature_record(input_ids, torch.tensor(mask), hidden)
        if record is not None:
            torch.save(record, out / f"data_{index:06d}.ckpt")
            written += 1
    return written


def specforge_draft_config(config: Any) -> dict[str, Any]:
    """fleet's export config of this run's drafter (``training.export.export_config``), with the
    ``auto_map`` SpecForge's AutoDraftModelConfig resolves the class by."""
    from training.export import export_config, run_target_config
    from training.run.core import drafter_config, mask_token_id

    target_config, tokenizer = run_target_config(config)
    cfg = replace(drafter_config(config), mask_token_id=mask_token_id(config, tokenizer, target_config))
    body = export_config(cfg, target_config, tokenizer)
    return {**body, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}


def features_for(config: Any, out: Path, data_cache: Path) -> dict[str, Any]:
    """``out``/draft.json and ``out``/features/ for the rows ``config``'s run trains on (its
    ``TrainData.rows``: the held-out rows are not among them); the split's counts."""
    import torch

    from training.model.target import load_tokenizer, model_source
    from training.run.core import load_model, load_train_data

    folder, tok_dir = model_source(config)
    tokenizer = load_tokenizer(tok_dir)
    data = load_train_data(config, tokenizer, data_cache, echo=log)
    draft = specforge_draft_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft.json").write_text(json.dumps(draft, indent=1))
    target = load_model(config, folder)
    if torch.cuda.is_available():
        target = target.to("cuda", torch.bfloat16)
    started = time.time()
    layer_ids = list(draft["dflash_config"]["target_layer_ids"])
    n = write_features(data.rows, out / "features", target, layer_ids)
    split = {
        "train_rows": len(data.rows),
        "features": n,
        "held_out": len(data.eval_rows),
        "layer_ids": layer_ids,
        "seconds": time.time() - started,
    }
    (out / "split.json").write_text(json.dumps(split, indent=1))
    return split


def cmd_features(args: argparse.Namespace) -> None:
    config = fleet_config(fleet_overrides(args, args.out / "train.jsonl"))
    split = features_for(config, args.out / "specforge", args.out / "features-data-cache")
    log(f"features: {split['features']} files of {split['train_rows']} rows in {split['seconds']:.1f} s")


def specforge_arms(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(arm name, seed) of each SpecForge arm: ``specforge`` for the first seed, ``specforge-sN`` after."""
    seeds = [int(s) for s in str(args.specforge_seeds).split(",") if s.strip()]
    return [("specforge" if i == 0 else f"specforge-s{seed}", seed) for i, seed in enumerate(seeds)]


def specforge_out(args: argparse.Namespace, arm: str) -> Path:
    return args.out / "specforge" / "out" / arm


def specforge_run_yaml(
    args: argparse.Namespace, target_folder: str, arm: str = "specforge", seed: int = 0
) -> str:
    """SpecForge's run config: shared/context/specforge-smol's, at this benchmark's steps and
    ``seed``; the batch (16 rows of <= 768 tokens), lr, warmup, anchors and gamma are smol-h200's."""
    config = fleet_config()
    sf = args.out / "specforge"
    every = points(args.steps, args.points)[0]
    mask_id = json.loads((sf / "draft.json").read_text())["dflash_config"]["mask_token_id"]
    return "\n".join(
        [
            "model:",
            f"  target_model_path: {target_folder}",
            f"  draft_model_config: {sf / 'draft.json'}",
            f"  mask_token_id: {mask_id}",
            "  torch_dtype: bfloat16",
            "data:",
            f"  hidden_states_path: {sf / 'features'}",
            f"  max_length: {config.data.max_length}",
            "training:",
            "  strategy: dflash",
            "  num_epochs: 1000",
            f"  max_steps: {args.steps}",
            f"  batch_size: {config.data.max_batch_size}",
            f"  learning_rate: {config.train.lr}",
            f"  warmup_ratio: {max(1, args.steps // 10) / args.steps}",
            f"  max_grad_norm: {config.train.grad_clip}",
            "  attention_backend: flex_attention",
            f"  num_anchors: {config.drafter.num_anchors}",
            f"  loss_decay_gamma: {config.drafter.gamma}",
            "  log_interval: 50",
            f"  save_interval: {every}",
            f"  seed: {seed}",
            f"run_id: {SPECFORGE_RUN_ID}",
            f"output_dir: {specforge_out(args, arm)}",
            "deployment:",
            "  mode: local_colocated",
            "  trainer:",
            "    nnodes: 1",
            "    nproc_per_node: 1",
            "",
        ]
    )


def train_specforge(args: argparse.Namespace, arm: str, seed: int) -> None:
    from training.model.target import model_source

    folder, _ = model_source(fleet_config())
    sf = args.out / "specforge"
    (sf / f"{arm}.yaml").write_text(specforge_run_yaml(args, folder, arm, seed))
    argv = [sys.executable, "-m", "specforge.cli", "train", "-c", str(sf / f"{arm}.yaml")]
    log(f"{arm}: {' '.join(argv[1:])}")
    started = time.time()
    with open(args.out / f"{arm}.log", "w") as out:
        code = subprocess.run(argv, cwd=sf, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.time() - started
    log(f"{arm}: exit {code} in {wall:.1f} s")
    save(
        args.out,
        arm,
        {
            "arm": arm,
            "argv": argv[1:],
            "exit_code": code,
            "wall_s": wall,
            "train_s": wall,
            "steps": args.steps,
            "seed": seed,
        },
    )


def cmd_specforge(args: argparse.Namespace) -> None:
    """Each SpecForge arm (``--specforge-seeds``): one after another, or at once with ``--concurrent``."""
    arms = specforge_arms(args)
    with ThreadPoolExecutor(max_workers=len(arms) if args.concurrent else 1) as pool:
        list(pool.map(lambda a: guarded(a[0], lambda x: train_specforge(x, *a), args), arms))


# --------------------------------------------------------------------------------------------- eval
def run_logged(argv: list[str], log_path: Path) -> int:
    with open(log_path, "w") as out:
        return subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def export_jobs(args: argparse.Namespace) -> list[tuple[str, int, Path, list[str]]]:
    """(arm, step, export folder, the command that writes it) of every checkpoint to evaluate."""
    jobs = []
    for arm in ("fleet", *(lever.name for lever in args.levers)):
        run_dir = args.out / arm
        for step in points(arm_steps(args, arm), args.points):
            if (run_dir / CHECKPOINT_DIR / (CHECKPOINT_FORMAT % step)).is_file():
                folder = args.out / "exports" / f"{arm}-{step}"
                argv = [
                    sys.executable,
                    "-m",
                    "training",
                    "export",
                    "--run-dir",
                    str(run_dir),
                    "--step",
                    str(step),
                    "--out",
                    str(folder),
                ]
                jobs.append((arm, step, folder, argv))
    from training.model.target import model_source

    target_folder, _ = model_source(fleet_config())
    sf = args.out / "specforge"
    for arm, step in (
        (arm, step) for arm, _ in specforge_arms(args) for step in points(args.steps, args.points)
    ):
        ckpt = specforge_out(args, arm) / f"{SPECFORGE_RUN_ID}-step{step}"
        if ckpt.is_dir():
            folder = args.out / "exports" / f"{arm}-{step}"
            argv = [
                sys.executable,
                "-m",
                "specforge.cli",
                "export",
                "--to",
                "hf",
                "--checkpoint",
                str(ckpt),
                "--draft-config",
                str(sf / "draft.json"),
                "--output-dir",
                str(folder),
                "--embedding-source",
                target_folder,
            ]
            jobs.append((arm, step, folder, argv))
    return jobs


def eval_tau(
    args: argparse.Namespace, arm: str, folder: Path, split: str, prompts: int, label: str
) -> dict | None:
    """fleet's evaluator on ``folder`` against the held-out prompts every arm shares (or ``arm``'s
    own training prompts), with the evaluation settings of ``arm``'s run (every arm's: smol-h200's)."""
    run_dir = args.out / ("fleet" if arm.startswith("specforge") else arm)
    argv = [
        sys.executable,
        "-m",
        "training",
        "eval",
        "--run-dir",
        str(run_dir),
        "--export",
        str(folder),
        f"--eval.sets={split}",  # that set alone, whatever the run's eval.sets (its general set too)
        f"--eval.num_prompts={prompts}",
    ]
    code = run_logged(argv, args.out / "evals" / f"{label}.log")
    # an export's eval writes no event into the run: its result is its line
    text = (args.out / "evals" / f"{label}.log").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("eval export") and f"({split})" in ln), "")
    if code != 0 or not line:
        log(f"eval {label}: exit {code}")
        return None
    tau = float(line.split("tau_mean=")[1].split()[0])
    per_prompt = float(line.split("per round, ")[1].split()[0])
    return {"tau_mean": tau, "tau_prompt_mean": per_prompt, "line": line}


def zlab_tau(args: argparse.Namespace, arm: str, folder: Path, label: str) -> dict | None:
    """The second evaluator: z-lab's own decoding loop (the ``dflash`` package, benchmarks/zlab_eval.py)
    on the same held-out prompts; None where the package is not installed or its run failed."""
    if args.no_zlab or importlib.util.find_spec("dflash") is None:
        return None
    run_dir = args.out / ("fleet" if arm.startswith("specforge") else arm)
    log_path = args.out / "evals" / f"zlab-{label}.log"
    argv = [sys.executable, str(REPO / "benchmarks" / "zlab_eval.py"), "--run-dir", str(run_dir)]
    argv += ["--export", str(folder), "--eval.split=held_out", f"--eval.num_prompts={args.held_out}"]
    code = run_logged(argv, log_path)
    found = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    if code != 0 or not found:
        log(f"z-lab eval {label}: exit {code}")
        return None
    data = json.loads(found[-1])
    return {key: data[key] for key in ("tau_mean", "tau_prompt_mean", "rounds", "prompts", "dflash_version")}


def cmd_eval(args: argparse.Namespace) -> None:
    (args.out / "exports").mkdir(parents=True, exist_ok=True)
    (args.out / "evals").mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: dict[str, Any] = dict(json.loads(path.read_text()).get("evals", {})) if path.is_file() else {}
    jobs = [job for job in export_jobs(args) if f"{job[0]}-{job[1]}" not in results]

    def one(job: tuple[str, int, Path, list[str]]) -> None:
        arm, step, folder, argv = job
        label = f"{arm}-{step}"
        if run_logged(argv, args.out / "evals" / f"export-{label}.log") != 0:
            log(f"export {label} failed")
            return
        got = eval_tau(args, arm, folder, "held_out", args.held_out, label)
        results[label] = {
            "arm": arm,
            "step": step,
            "held_out": got,
            "zlab": zlab_tau(args, arm, folder, label),
        }
        log(f"eval {label}: {got and got['tau_mean']}")
        save(args.out, "evals", dict(results))  # each as it comes: a stopped job keeps the done ones

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(one, jobs))
    # memorisation or mismatch: the same checkpoint on training prompts
    for arm in args.diag.split(","):
        last = points(arm_steps(args, arm), args.points)[-1]
        folder = args.out / "exports" / f"{arm}-{last}"
        key = f"diagnostic-{arm}"
        if folder.is_dir() and key not in results:
            results[key] = {
                "arm": arm,
                "step": last,
                "train": eval_tau(args, arm, folder, "train", args.diag_prompts, f"diag-train-{arm}"),
                "held_out": eval_tau(
                    args, arm, folder, "held_out", args.diag_prompts, f"diag-held-out-{arm}"
                ),
            }
    save(args.out, "evals", results)


# ------------------------------------------------------------------------------------------- report
SAVING = threading.Lock()  # arms trained at once save their results from threads


def save(out: Path, name: str, data: Any) -> None:
    with SAVING:
        path = out / "results.json"
        found = json.loads(path.read_text()) if path.is_file() else {}
        found[name] = data
        tmp = path.with_name(".results.json.tmp")
        tmp.write_text(json.dumps(found, indent=1, sort_keys=True))
        tmp.replace(path)


def curves(results: dict[str, Any], evaluator: str = "held_out") -> dict[str, list[tuple[int, float]]]:
    """Each arm's (step, held-out tau per round) by fleet's eval (``held_out``) or z-lab's loop (``zlab``)."""
    found: dict[str, list[tuple[int, float]]] = {}
    for label, item in results.get("evals", {}).items():
        if not label.startswith("diagnostic") and item.get(evaluator):
            found.setdefault(item["arm"], []).append((item["step"], item[evaluator]["tau_mean"]))
    return {arm: sorted(points_) for arm, points_ in found.items()}


def seconds_at(run: dict[str, Any], step: int, total: int) -> float | None:
    """Seconds from an arm's launch to ``step``: its logged step's time where the run recorded it
    (fleet), else its training seconds pro rata (SpecForge logs no times: an estimate that spreads
    its compile over every step, so it favours SpecForge's early checkpoints)."""
    if str(step) in run.get("at_step", {}):
        return run["at_step"][str(step)]
    return run["train_s"] * step / total if run.get("train_s") else None


def time_to_reach(curve: list[tuple[float, float]], goal: float) -> float | None:
    """The first time a (seconds, tau) curve reaches ``goal``, linear between its points (from
    (0, 1.0): a drafter that accepts nothing still advances one token a round); None if it never does."""
    last_t, last_tau = 0.0, 1.0
    for t, tau in curve:
        if tau >= goal:
            return last_t + (t - last_t) * (goal - last_tau) / (tau - last_tau) if tau > last_tau else t
        last_t, last_tau = t, tau
    return None


def timed_curve(
    run: dict[str, Any], arm: str, curve: list[tuple[int, float]], args: argparse.Namespace
) -> list[tuple[float, float]] | None:
    """An arm's (seconds from launch, tau) points; None when a checkpoint has no time."""
    total = run.get("steps") or arm_steps(args, arm)
    timed = []
    for step, tau in curve:
        seconds = seconds_at(run, step, total)
        if seconds is None:
            return None
        timed.append((seconds, tau))
    return timed


def reach_lines(results: dict[str, Any], args: argparse.Namespace, reference: str = "specforge") -> list[str]:
    """For each fleet arm: when it reaches the reference arm's final held-out tau, against the
    reference's training seconds (the goal: <= 0.7x)."""
    taus = curves(results)
    ref_run = results.get(reference, {})
    if reference not in taus or not ref_run.get("train_s"):
        return []
    goal = taus[reference][-1][1]
    lines = [f"\n{reference}'s final held-out tau {goal:.3f} after {ref_run['train_s']:.1f} s of training:"]
    for arm, curve in taus.items():
        run = results.get(arm, {})
        seed = seed_of(arm, run)
        # fleet at another seed is set beside SpecForge at its own seed (the pairs' table)
        if arm.startswith("specforge") or (seed is not None and ref_run.get("seed", seed) != seed):
            continue
        timed = timed_curve(run, arm, curve, args)
        if timed is None:
            continue
        reached = time_to_reach(timed, goal)
        lines.append(
            f"- {arm}: "
            + (
                f"reaches it at {reached:.1f} s = {reached / ref_run['train_s']:.2f}x"
                if reached is not None
                else f"does not reach it (best {max(t for _, t in curve):.3f})"
            )
        )
    return lines


SEED_OVERRIDES = ("--train.seed=", "--data.seed=")


def seed_of(arm: str, run: dict[str, Any]) -> int | None:
    """The seed of an arm that is one trainer's recipe at one seed: SpecForge's YAML ``seed``;
    fleet's last ``--train.seed`` (the config's 0 without one) for the base arm and for levers
    that change the seeds alone. Any other lever has no SpecForge twin: None."""
    if arm.startswith("specforge"):
        return run.get("seed")
    lever = run.get("lever")
    if lever is not None and (
        lever["data"] != "base" or not all(o.startswith(SEED_OVERRIDES) for o in lever["overrides"])
    ):
        return None
    seeds = [int(a.partition("=")[2]) for a in run.get("argv", []) if a.startswith("--train.seed=")]
    return seeds[-1] if seeds else 0


def seed_pairs(results: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """fleet and SpecForge at the same seed and final step: their final held-out taus, the gap, each
    one's training seconds and the seconds fleet takes to reach that seed's SpecForge final tau."""
    taus = curves(results)
    by_seed: dict[int, dict[str, str]] = {}
    for arm in taus:
        seed = seed_of(arm, results.get(arm, {}))
        if seed is not None:
            trainer = "specforge" if arm.startswith("specforge") else "fleet"
            by_seed.setdefault(seed, {}).setdefault(trainer, arm)
    pairs = []
    for seed, arms in sorted(by_seed.items()):
        if len(arms) != 2 or taus[arms["fleet"]][-1][0] != taus[arms["specforge"]][-1][0]:
            continue
        fleet, ref = results.get(arms["fleet"], {}), results.get(arms["specforge"], {})
        (step, ours), (_, theirs) = taus[arms["fleet"]][-1], taus[arms["specforge"]][-1]
        timed = timed_curve(fleet, arms["fleet"], taus[arms["fleet"]], args)
        reached = None if timed is None else time_to_reach(timed, theirs)
        pairs.append(
            {
                "seed": seed,
                "step": step,
                "fleet": arms["fleet"],
                "specforge": arms["specforge"],
                "fleet_tau": ours,
                "specforge_tau": theirs,
                "gap": ours - theirs,
                "fleet_s": fleet.get("train_s"),
                "specforge_s": ref.get("train_s"),
                "reached_s": reached,
            }
        )
    return pairs


# Student's t at one-sided 95% for 1-30 degrees of freedom (3 decimals, as printed in every table);
# past 30, 30's value: a little wider than the normal's 1.645, never narrower.
T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
    1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip


def pair_lines(pairs: list[dict[str, Any]]) -> list[str]:
    """The pairs as a table, then the mean gap over seeds with its standard error (the sample's
    standard deviation over the square root of the count): one seed's gap is one draw of a spread.
    With it the one-sided 95% lower bound of the mean gap (mean - t x error, n - 1 degrees of
    freedom): the goal "fleet >= SpecForge - 0.02" holds at that confidence when the bound does."""
    if not pairs:
        return []
    lines = [
        "\n| seed | step | fleet | SpecForge | fleet - SpecForge | training s, fleet / SpecForge | "
        "fleet's time to SpecForge's final tau |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in pairs:
        seconds = " / ".join(f"{s:.1f}" if s else "not timed" for s in (p["fleet_s"], p["specforge_s"]))
        if p["reached_s"] is None:
            reach = "not reached"
        elif p["specforge_s"]:
            reach = f"{p['reached_s'] / p['specforge_s']:.2f}x"
        else:
            reach = f"at {p['reached_s']:.1f} s (SpecForge not timed)"
        lines.append(
            f"| {p['seed']} | {p['step']} | {p['fleet_tau']:.3f} | {p['specforge_tau']:.3f} | "
            f"{p['gap']:+.3f} | {seconds} | {reach} |"
        )
    gaps = [p["gap"] for p in pairs]
    seeds = len({p["seed"] for p in pairs})
    if len(gaps) > 1:
        error = statistics.stdev(gaps) / len(gaps) ** 0.5
        over = f"{seeds} seeds" if seeds == len(gaps) else f"{len(gaps)} pairs ({seeds} seeds)"
        mean, df = statistics.mean(gaps), len(gaps) - 1
        t = T95[min(df, len(T95)) - 1]
        lines.append(
            f"\nmean gap over {over}: {mean:+.3f} (standard error {error:.3f}); one-sided 95% lower bound "
            f"{mean - t * error:+.3f} (t {t:.3f}, {df} df)"
        )
    return lines


def pyplot() -> Any:
    """matplotlib's pyplot on the file backend, or None where it is not installed (no plot then)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def cmd_pairs(args: argparse.Namespace) -> None:
    """Every seed pair of the runs kept under ``--out`` (one folder each, as ``all`` leaves them:
    one device call trains one seed's pair), in one table with the mean gap over them all."""
    found = sorted(args.out.glob("*/results.json"))
    if not found:
        raise SystemExit(f"quality_bench: no */results.json under {args.out}: put each run's folder there")
    runs = {path.parent.name: json.loads(path.read_text()) for path in found}
    pairs = [p for run in runs.values() for p in seed_pairs(run, args)]
    lines = pair_lines(sorted(pairs, key=lambda p: p["seed"])) or ["no seed pairs in those runs"]
    text = "\n".join([*lines, "", data_line(runs)]).lstrip()
    (args.out / "pairs.md").write_text(text + "\n")
    print(text)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    seeds = [p["seed"] for p in pairs]
    for trainer, marker in (("fleet", "o"), ("specforge", "s")):
        ax.scatter(seeds, [p[f"{trainer}_tau"] for p in pairs], marker=marker, label=trainer)
    ax.set_xticks(sorted(set(seeds)))
    ax.set(xlabel="seed (both trainers)", ylabel=f"held-out tau per round ({args.held_out} prompts)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "pairs.png", dpi=110)


def cmd_report(args: argparse.Namespace) -> None:
    results = json.loads((args.out / "results.json").read_text())
    lines = [
        "| arm | exit | training s | held-out tau per step | the same by z-lab's loop |",
        "| --- | --- | --- | --- | --- |",
    ]
    zlab = curves(results, "zlab")
    for arm, curve in curves(results).items():
        run = results.get(arm, {})
        taus = ", ".join(f"{step}: {tau:.3f}" for step, tau in curve)
        theirs = ", ".join(f"{step}: {tau:.3f}" for step, tau in zlab.get(arm, [])) or "not run"
        lines.append(
            f"| {arm} | {run.get('exit_code')} | {run.get('train_s') or 0:.1f} | {taus} | {theirs} |"
        )
    for label, diag in results.get("evals", {}).items():
        if label.startswith("diagnostic"):
            t, h = diag.get("train") or {}, diag.get("held_out") or {}
            lines.append(
                f"\nmemorisation check, {diag['arm']} step {diag['step']}: training prompts "
                f"tau {t.get('tau_mean')}, held-out {h.get('tau_mean')} ({args.diag_prompts} each)"
            )
    lines += reach_lines(results, args)
    lines += pair_lines(seed_pairs(results, args))
    text = "\n".join(lines)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    plt = pyplot()
    if plt is None:
        return
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, curve in curves(results).items():
        steps = [s for s, _ in curve]
        taus = [t for _, t in curve]
        by_step.plot(steps, taus, marker="o", label=arm)
        run = results.get(arm, {})
        seconds = [seconds_at(run, s, run.get("steps") or arm_steps(args, arm)) for s in steps]
        if None not in seconds:
            by_time.plot(seconds, taus, marker="o", label=arm)
    by_step.set(xlabel="training step", ylabel=f"held-out tau per round ({args.held_out} prompts)")
    by_time.set(xlabel="seconds from launch (SpecForge: pro rata)", ylabel="held-out tau per round")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "quality.png", dpi=110)


def guarded(name: str, step: Any, args: argparse.Namespace) -> None:
    try:
        step(args)
    except Exception as exc:  # one failed arm must not lose the others' figures
        log(f"{name} failed: {type(exc).__name__}: {exc}")
        save(args.out, f"{name}-error", f"{type(exc).__name__}: {exc}")


def cmd_all(args: argparse.Namespace) -> None:
    """The arms in an order that keeps the timed training alone on the GPU: the packages rows are
    regenerated beside the first arms' evals (not timed), the packages levers trained after them.
    ``--concurrent``: every arm at once, the packages levers as soon as their rows are."""
    base = [lv for lv in args.levers if lv.data == "base"]
    more = [lv for lv in args.levers if lv.data == "packages"]
    early = start_packages_regen(args) if more and args.concurrent else None
    guarded("data", cmd_data, args)

    def lever(lv: Lever) -> None:
        guarded(lv.name, lambda a: train_lever(a, lv), args)

    def specforge() -> None:
        guarded("features", cmd_features, args)
        guarded("specforge", cmd_specforge, args)

    def packages() -> None:  # --concurrent: the packages rows, then their levers at once
        if early is not None:
            log(f"packages rows regenerated: exit {early.wait()}")
        guarded("packages-data", cmd_packages_data, args)
        with ThreadPoolExecutor(max_workers=len(more)) as pool:
            list(pool.map(lever, more))

    first = [lambda: guarded("fleet", cmd_fleet, args)] if "fleet" in args.arms else []
    first += [specforge] if "specforge" in args.arms else []
    first += [lambda lv=lv: lever(lv) for lv in base]
    with ThreadPoolExecutor(max_workers=len(first) + 1) as pool:
        if args.concurrent:
            later = pool.submit(packages) if more else None
            list(pool.map(lambda job: job(), first))
        else:
            for job in first:
                job()
            later = pool.submit(guarded, "packages-data", cmd_packages_data, args) if more else None
        guarded("eval", cmd_eval, args)  # the finished arms' checkpoints, beside what still runs
        if later is not None:
            later.result()
    if more and not args.concurrent:
        for lv in more:
            lever(lv)
    if more:
        guarded("eval", cmd_eval, args)
    guarded("report", cmd_report, args)


def main(argv: list[str] | None = None) -> int:
    global CONFIG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = {"all": cmd_all, "data": cmd_data, "fleet": cmd_fleet, "features": cmd_features}
    steps |= {"specforge": cmd_specforge, "packages-data": cmd_packages_data, "levers": cmd_levers}
    steps |= {"packages-regen": cmd_packages_regen}
    steps |= {"eval": cmd_eval, "report": cmd_report, "pairs": cmd_pairs}
    parser.add_argument("step", choices=tuple(steps))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--points", type=int, default=4, help="checkpoints evaluated per arm")
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--diag-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="fleet,specforge", help="of fleet,specforge")
    parser.add_argument(
        "--lever",
        action="append",
        default=[],
        metavar='"NAME=DATA[@STEPS] --section.key=value ..."',
        help="fleet with one change, DATA base or packages (repeatable)",
    )
    parser.add_argument("--specforge-seeds", default="0", help="one SpecForge arm per seed (0,1,2)")
    parser.add_argument("--no-zlab", action="store_true", help="fleet's evaluator alone (z-lab's loop off)")
    parser.add_argument("--diag", default="fleet", help="arms run on train prompts too")
    parser.add_argument("--concurrent", action="store_true", help="train the arms at once")
    parser.add_argument("--packages-prompts", type=int, default=12000)
    parser.add_argument("--regen-batch", type=int, default=512, help="the packages lever's regen batch")
    parser.add_argument("--parallel", type=int, default=6, help="exports + evals at a time")
    parser.add_argument(
        "--run-eval-prompts", type=int, default=8, help="each fleet run's own end-of-run eval (0: none)"
    )
    parser.add_argument("--config", default="smol-h200", help="the run config every arm trains")
    parser.add_argument("--set", action="append", default=[], metavar="--SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    CONFIG = args.config
    EXTRA[:] = [*reference_overrides(CONFIG), *args.set]
    args.out = args.out.resolve()
    args.levers = [Lever.parse(text) for text in args.lever]
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    steps[args.step](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
