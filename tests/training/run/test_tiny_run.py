"""The done-when run: the tiny default trains on the default corpus, loss halves, eval reports tau."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import ONE_THREAD

from training.data.buckets import parse_bucket_table
from training.events import read_events, validate_event

REPO = Path(__file__).resolve().parents[3]
# The tiny configs evaluate the held-out split alone without trees (their default); these two runs
# measure what smol-cpu does by default: both eval sets and DDTree's budgets, end to end.
SETS_AND_TREES = ["--eval.sets=held_out,general", "--eval.tree_budgets=16,64,256"]

pytestmark = pytest.mark.slow


def test_tiny_cpu_run_halves_its_loss_and_eval_reports_tau(tiny_cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FLEET_TRAINING_CACHE": str(tiny_cache)}
    run_dir = tmp_path / "run"
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--config",
            "tiny-cpu",
            "--run-dir",
            str(run_dir),
            *ONE_THREAD,
            *SETS_AND_TREES,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    table = parse_bucket_table(train.stdout)  # the start-up table is in the user's format
    assert table.batches_per_epoch == sum(b.batches for b in table.buckets) > 0

    events = read_events(run_dir / "events.jsonl")
    problems = [(e["event"], validate_event(e)) for e in events if validate_event(e)]
    assert problems == []
    steps = [e for e in events if e["event"] == "step"]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == steps[-1]["total_steps"]
    # Step losses are noisy (small batches): the mean of the last five logged ones must be
    # below half of the first step's loss.
    final = sum(e["loss"] for e in steps[-5:]) / 5
    assert final < steps[0]["loss"] / 2, (steps[0]["loss"], [e["loss"] for e in steps])
    assert [e["phase"] for e in events if e["event"] == "phase"][-1] == "done"
    assert (run_dir / "config.json").is_file()

    # DDTree's cost measured on the CPU too (auto: GPUs only), two budgets: the one table
    tree = ["--eval.tree_cost=on", "--eval.tree_cost_budgets=0,16"]
    evaluate = subprocess.run(
        [sys.executable, "-m", "training", "eval", "--run-dir", str(run_dir), *tree],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    assert "tau_mean=" in evaluate.stdout
    evals = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "eval"]
    # the end of training + the eval command, each on both eval.sets (the held-out split, general)
    assert [(e["set"], e["split"]) for e in evals] == [("held_out", "held_out"), ("general", "general")] * 2
    assert f"eval step {steps[-1]['step']} (general): tau_mean=" in train.stdout
    for e in evals:
        assert e["tau_mean"] >= 1.0 and sum(e["tau_hist"]) > 0
        assert e["step"] == steps[-1]["step"]
        # DDTree at the default budgets (eval.tree_budgets), replayed
        assert [t["budget"] for t in e["tree"]] == [16, 64, 256], e
        assert all(
            t["rounds"] == sum(t["hist"]) > 0 and t["tree_size_mean"] <= t["budget"] for t in e["tree"]
        )
    # the same checkpoint, the same figures: each set's tree as the end of training measured it
    assert [e["tree"] for e in evals[2:]] == [e["tree"] for e in evals[:2]]
    # with the cost measured, the one table has its times and modelled speedups (the best marked)
    table = evaluate.stdout.splitlines()
    header = next(i for i, ln in enumerate(table) if ln.split()[:4] == ["budget", "tau", "x", "chain"])
    assert table[header].split()[4:] == ["tree", "verify", "ms", "speedup"]
    assert [ln.split()[0] for ln in table[header + 1 : header + 5]] == ["chain", "16", "64", "256"]
    assert not any("tree_cost" in e for e in evals[:2])  # the training's eval on the CPU: auto is off
    cost = evals[2]["tree_cost"]
    assert evals[3]["tree_cost"]["t_verify_s"] == cost["t_verify_s"]  # measured once per process
    assert set(cost["t_verify_s"]) == set(cost["speedup"]) == {"0", "16"} and cost["device"] == "cpu"
    assert cost["best_budget"] in (0, 16) and "<- best" in evaluate.stdout

    # The exported folder is the same drafter: eval --export measures the same acceptance.
    export = run_dir.parent / "drafter"
    cmd = [sys.executable, "-m", "training", "export", "--run-dir", str(run_dir), "--out", str(export)]
    exported = subprocess.run([*cmd, "--dtype", "float32"], cwd=REPO, env=env, capture_output=True, text=True)
    assert exported.returncode == 0 and f"-> {export}" in exported.stdout, exported.stderr[-3000:]
    # (the held-out split: its figure is the one compared)
    export_eval = ["eval", "--run-dir", str(run_dir), "--export", str(export), "--eval.sets=held_out"]
    from_export = subprocess.run(
        [sys.executable, "-m", "training", *export_eval],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert from_export.returncode == 0, from_export.stderr[-3000:]
    # Labelled by the folder, not by the run's newest step, and not written into the run's events
    # (the folder is not the run's checkpoint: `fab status` must not show it as the run's eval).
    line = next(ln for ln in from_export.stdout.splitlines() if ln.startswith("eval "))
    assert line.startswith(f"eval export {export} (held_out): tau_mean="), line
    assert f"hist={evals[2]['tau_hist']}" in line, (line, evals[2])
    # no cost measured (the CPU's default): the tree table alone
    table = from_export.stdout.splitlines()
    header = next(
        i
        for i, ln in enumerate(table)
        if ln.split() == ["budget", "tau", "tau/prompt", "x", "chain", "tree", "size"]
    )
    assert [ln.split()[0] for ln in table[header + 1 : header + 5]] == ["chain", "16", "64", "256"]
    assert [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "eval"] == evals


def test_tiny_qwen3_5_run_from_the_multimodal_layout_trains_and_evaluates(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """The hybrid target (Gated DeltaNet + full attention), saved as the published Qwen3.6 folders
    are (multimodal), loaded text-only: a short run learns, reports its kernels, and eval runs."""
    env = {**os.environ, "FLEET_TRAINING_CACHE": str(tiny_cache)}
    run_dir = tmp_path / "run"
    overrides = [
        "--model.checkpoint_layout=multimodal",
        "--train.steps=20",
        "--checkpoint.every=0",
        *ONE_THREAD,
        *SETS_AND_TREES,
    ]
    overrides += ["--eval.num_prompts=2", "--eval.max_new_tokens=16"]
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--config",
            "tiny-qwen3.5-cpu",
            "--run-dir",
            str(run_dir),
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert (
        "Target layers [1 linear, 3 full, 5 linear] of 8 (6 linear-attention, 2 full-attention)"
        in train.stdout
    )
    events = read_events(run_dir / "events.jsonl")
    assert [(e["event"], validate_event(e)) for e in events if validate_event(e)] == []
    (target,) = [e for e in events if e["event"] == "target"]
    assert target["model_type"] == "qwen3_5_text" and target["layer_ids"] == [1, 3, 5]
    assert target["linear_layers"] == 6 and target["fast_path"] == "no"  # CPU: transformers' torch path
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["step"] == 20
    assert sum(e["loss"] for e in steps[-2:]) / 2 < 0.75 * steps[0]["loss"], [e["loss"] for e in steps]

    # DDTree's cost measured on the CPU too (auto: GPUs only), two budgets: the one table
    tree = ["--eval.tree_cost=on", "--eval.tree_cost_budgets=0,16"]
    evaluate = subprocess.run(
        [sys.executable, "-m", "training", "eval", "--run-dir", str(run_dir), *tree],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    evals = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "eval"]
    assert [e["set"] for e in evals] == ["held_out", "general"] * 2
    assert all(e["tau_mean"] >= 1.0 and sum(e["tau_hist"]) > 0 for e in evals)
    # DDTree on the hybrid: replayed (its Gated DeltaNet state cannot branch into a tree)
    assert all([t["budget"] for t in e["tree"]] == [16, 64, 256] for e in evals), evals
