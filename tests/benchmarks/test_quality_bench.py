"""benchmarks/quality_bench.py on a CPU: the held-out split both arms share, the SpecForge feature
files (the keys, dtypes and shapes its offline reader takes: specforge/runtime/data_plane/
offline_reader.py, shared/context/specforge-smol) written for exactly the rows fleet trains on,
and the draft config written from fleet's export config. The tiny target stands in for SmolLM2
(same code path, CPU size); the device run (benchmarks/gpu/quality.sh) feeds them to SpecForge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit import benchmark

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "context" / "specforge-smol" / "smol-dflash.json"


def bench():  # type: ignore[no-untyped-def]
    return benchmark("quality_bench")


def rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Write a Python function `f{i}(x)`: return x plus {i}"},
                {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 3)},
            ]
        }
        for i in range(n)
    ]


def test_the_held_out_split_is_seeded_disjoint_and_in_file_order() -> None:
    q = bench()
    data = rows(40)
    held, train = q.split_rows(data, 8, seed=0)
    again, _ = q.split_rows(data, 8, seed=0)
    other, _ = q.split_rows(data, 8, seed=1)
    assert held == again and held != other
    assert len(held) == 8 and len(train) == 32
    prompts = {q.prompt_of(r) for r in held}
    assert not prompts & {q.prompt_of(r) for r in train}
    assert [data.index(r) for r in held] == sorted(data.index(r) for r in held)
    assert q.points(800, 4) == [200, 400, 600, 800] and q.points(10, 3) == [3, 6, 10]


@pytest.mark.slow
def test_features_are_specforges_format_for_exactly_the_rows_fleet_trains_on(tmp_path: Path) -> None:
    import torch

    from training.config import load_config
    from training.model.target import load_tokenizer, model_source
    from training.run.core import load_train_data

    q = bench()
    held, train = q.split_rows(rows(24), 6, seed=0)
    q.write_jsonl(tmp_path / "heldout.jsonl", held)
    q.write_jsonl(tmp_path / "train.jsonl", train)
    overrides = [
        f"--data.path={tmp_path / 'train.jsonl'}",
        f"--data.eval_path={tmp_path / 'heldout.jsonl'}",
        f"--model.cache_dir={tmp_path / 'models'}",
    ]
    config = load_config("tiny-cpu", overrides)
    split = q.features_for(config, tmp_path / "sf", tmp_path / "cache")
    assert split["train_rows"] == 18 and split["held_out"] == 6

    _folder, tok_dir = model_source(config)
    data = load_train_data(config, load_tokenizer(tok_dir), tmp_path / "cache", echo=lambda _line: None)
    eval_prompts = [q.prompt_of(r) for r in held]
    assert len(data.eval_rows) == 6 and len(data.rows) == 18
    files = sorted((tmp_path / "sf" / "features").glob("data_*.ckpt"))
    assert len(files) == split["features"] > 0
    hidden = config.model.hidden_size
    layer_ids = split["layer_ids"]
    trained = {tuple(ids) for ids in data.rows["input_ids"]}
    for path in files:
        sample = torch.load(path, weights_only=False, mmap=True)  # as SpecForge's load_feature_file
        assert set(sample) == {"input_ids", "loss_mask", "hidden_states"}
        ids, mask, states = sample["input_ids"], sample["loss_mask"], sample["hidden_states"]
        t = ids.shape[0]
        assert ids.dtype == torch.long and ids.dim() == 1
        assert mask.shape == (t,) and set(mask.unique().tolist()) <= {0, 1}
        assert bool((mask[1:] * mask[:-1]).any()), "SpecForge refuses a sample without 2 labelled tokens"
        assert states.dtype == torch.bfloat16 and states.shape == (1, t, len(layer_ids) * hidden)
        assert tuple(ids.tolist()) in trained
    held_ids = {tuple(ids) for ids in data.eval_rows["input_ids"]}
    assert not held_ids & trained and len(eval_prompts) == 6

    draft = json.loads((tmp_path / "sf" / "draft.json").read_text())
    assert draft["architectures"] == ["DFlashDraftModel"]
    assert draft["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert draft["dflash_config"]["target_layer_ids"] == layer_ids


def test_the_smol_drafter_has_the_reference_shape() -> None:
    """The drafter every arm trains on smol-h200 (its config + the benchmark's pinned shape): the
    shape shared/context/specforge-smol gives SpecForge (layers, layer types, window, block, target
    layers), whatever smol-h200's own recipe is."""
    from training.config import load_config
    from training.model.drafter import select_target_layers
    from training.run.core import drafter_config

    if not SHARED.is_file():
        pytest.skip(f"{SHARED} is not beside this checkout")
    ref = json.loads(SHARED.read_text())
    config = load_config("smol-h200", bench().reference_overrides("smol-h200"))
    cfg = drafter_config(config)
    assert (cfg.num_layers, cfg.layer_types(), cfg.sliding_window, cfg.block_size) == (
        ref["num_hidden_layers"],
        ref["layer_types"],
        ref["sliding_window"],
        ref["block_size"],
    )
    layers = select_target_layers(ref["num_target_layers"], config.drafter.num_target_layers)
    assert layers == ref["dflash_config"]["target_layer_ids"]
    # and the rows of the benchmark's recorded runs: replies to the shipped corpus' prompts alone,
    # generated in batches of 256 (the batch is part of the regenerated file's key)
    from training.data.regen import shipped_prompts

    assert shipped_prompts(config.data.regen_prompts, config.data.regen_sources) == shipped_prompts(3000)
    assert config.data.regen_batch_size == 256


def test_each_specforge_seed_is_an_arm_of_its_own_on_the_same_features(tmp_path: Path) -> None:
    """``--specforge-seeds 0,1``: two SpecForge runs that differ in their seed and output folder
    alone (the run-to-run spread of the reference trainer), reading the one feature folder."""
    import argparse

    q = bench()
    (tmp_path / "specforge").mkdir()
    (tmp_path / "specforge" / "draft.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 4}}))
    args = argparse.Namespace(out=tmp_path, steps=800, points=2, specforge_seeds="0,1")
    assert q.specforge_arms(args) == [("specforge", 0), ("specforge-s1", 1)]
    out = tmp_path / "specforge" / "out"
    first, second = (q.specforge_run_yaml(args, "/m", arm, seed) for arm, seed in q.specforge_arms(args))
    differ = [(a, b) for a, b in zip(first.splitlines(), second.splitlines(), strict=True) if a != b]
    assert differ == [
        ("  seed: 0", "  seed: 1"),
        (f"output_dir: {out}/specforge", f"output_dir: {out}/specforge-s1"),
    ]
    assert f"  hidden_states_path: {tmp_path}/specforge/features" in first.splitlines()
    with pytest.raises(SystemExit, match="NAME=DATA"):
        q.Lever.parse("specforge-s9=base --train.seed=9")
    seeded = q.Lever.parse("seed1=base --train.seed=1 --data.seed=1")
    assert seeded.overrides == ("--train.seed=1", "--data.seed=1")


def test_the_time_to_the_reference_tau_reads_each_arms_logged_step_times() -> None:
    """The goal "fleet reaches SpecForge's final tau in <= 0.7x its time": fleet's checkpoints are
    placed at their logged seconds (its compile is in the first steps, not spread), SpecForge's
    pro rata; the crossing is linear between the points, and an arm that never reaches it says so."""
    import argparse

    q = bench()
    args = argparse.Namespace(steps=800, points=2, levers=[])
    results = {
        "specforge": {"train_s": 200.0, "steps": 800},
        "fleet": {"train_s": 150.0, "steps": 800, "at_step": {"400": 90.0, "800": 150.0}},
        "slow": {"train_s": 300.0, "steps": 800},
        "evals": {
            f"{arm}-{step}": {"arm": arm, "step": step, "held_out": {"tau_mean": tau}}
            for arm, step, tau in [
                ("specforge", 400, 1.5),
                ("specforge", 800, 1.8),
                ("fleet", 400, 1.6),
                ("fleet", 800, 2.0),
                ("slow", 400, 1.2),
                ("slow", 800, 1.7),
            ]
        },
    }
    assert q.seconds_at(results["specforge"], 400, 800) == 100.0
    assert q.seconds_at(results["fleet"], 400, 800) == 90.0
    assert q.time_to_reach([(90.0, 1.6), (150.0, 2.0)], 1.8) == pytest.approx(120.0)
    assert q.time_to_reach([(90.0, 1.6)], 1.3) == pytest.approx(45.0)  # from (0 s, tau 1)
    assert q.time_to_reach([(90.0, 1.6)], 1.7) is None
    lines = q.reach_lines(results, args)
    assert lines[0].strip() == "specforge's final held-out tau 1.800 after 200.0 s of training:"
    assert lines[1:] == ["- fleet: reaches it at 120.0 s = 0.60x", "- slow: does not reach it (best 1.700)"]


def test_each_seed_pairs_fleet_with_specforge_at_that_seed_and_the_mean_gap_has_its_error() -> None:
    """Several seeds in one run: fleet at seed N is set beside SpecForge at seed N (not beside the
    first SpecForge arm); a lever that changes more than the seeds has no twin; the mean gap comes
    with its standard error."""
    import argparse

    q = bench()
    args = argparse.Namespace(steps=800, points=1, levers=[])
    base = ["-m", "training", "train", "--train.seed=2", "--data.seed=2"]

    def evals(*arm_tau: tuple[str, float]) -> dict:
        return {f"{a}-800": {"arm": a, "step": 800, "held_out": {"tau_mean": t}} for a, t in arm_tau}

    results = {
        "fleet": {"argv": base, "train_s": 90.0, "steps": 800, "at_step": {"800": 90.0}},
        "s3": {
            "argv": [*base, "--train.seed=3", "--data.seed=3"],
            "train_s": 60.0,
            "steps": 800,
            "at_step": {"800": 60.0},
            "lever": {"data": "base", "overrides": ["--train.seed=3", "--data.seed=3"]},
        },
        "allfull": {
            "argv": [*base, "--drafter.full_attention_layers=[0,1,2,3]"],
            "train_s": 80.0,
            "steps": 800,
            "lever": {"data": "base", "overrides": ["--drafter.full_attention_layers=[0,1,2,3]"]},
        },
        "specforge": {"seed": 2, "train_s": 150.0, "steps": 800},
        "specforge-s3": {"seed": 3, "train_s": 160.0, "steps": 800},
        "specforge-s4": {"seed": 4, "train_s": 170.0, "steps": 800},
        "evals": evals(
            ("fleet", 1.90), ("s3", 1.80), ("allfull", 2.0),
            ("specforge", 1.85), ("specforge-s3", 1.84), ("specforge-s4", 1.9),
        ),
    }  # fmt: skip
    assert [q.seed_of(a, results[a]) for a in ("fleet", "s3", "allfull", "specforge-s3")] == [2, 3, None, 3]
    pairs = q.seed_pairs(results, args)
    twins = [(p["seed"], p["fleet"], p["specforge"]) for p in pairs]
    assert twins == [(2, "fleet", "specforge"), (3, "s3", "specforge-s3")]
    assert [round(p["gap"], 3) for p in pairs] == [0.05, -0.04]
    # seed 2: 1.85 reached between (0 s, 1.0) and (90 s, 1.9) at 85 s of SpecForge's 150; seed 3 never
    assert pairs[0]["reached_s"] == pytest.approx(85.0) and pairs[0]["specforge_s"] == 150.0
    assert pairs[1]["reached_s"] is None
    lines = q.pair_lines(pairs)
    assert "| 2 | 800 | 1.900 | 1.850 | +0.050 | 90.0 / 150.0 | 0.57x |" in lines
    assert "| 3 | 800 | 1.800 | 1.840 | -0.040 | 60.0 / 160.0 | not reached |" in lines
    assert lines[-1].strip() == (
        "mean gap over 2 seeds: +0.005 (standard error 0.045); "
        "one-sided 95% lower bound -0.279 (t 6.314, 1 df)"
    )
    # the time-to-reach lines compare SpecForge's first arm (seed 2) with fleet's arms at seed 2 and the lever
    assert [ln.split(":")[0] for ln in q.reach_lines(results, args)[1:]] == ["- fleet", "- allfull"]
    assert q.pair_lines([]) == []
    untimed = {**pairs[0], "specforge_s": None}  # SpecForge's seconds unknown: not "not reached"
    assert (
        "| 2 | 800 | 1.900 | 1.850 | +0.050 | 90.0 / not timed | at 85.0 s (SpecForge not timed) |"
        in q.pair_lines([untimed])
    )


def test_the_data_step_records_the_sha256_of_the_files_both_arms_read(tmp_path: Path, monkeypatch) -> None:
    """``data`` writes the split and keeps each file's sha256 in results.json, so runs of other
    device calls can be shown to share their rows (checked here with hashlib on the files read back)."""
    import hashlib

    q = bench()
    regenerated = tmp_path / "regen.jsonl"
    regenerated.write_text("".join(json.dumps(row) + "\n" for row in rows(10)))
    monkeypatch.setattr(q, "regenerate", lambda overrides: regenerated)  # the target's replies, already made
    out = tmp_path / "run"
    assert q.main(["data", "--out", str(out), "--held-out", "3"]) == 0
    digests = json.loads((out / "results.json").read_text())["data"]
    files = ("train.jsonl", "heldout.jsonl")
    assert digests == {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files}
    assert len((out / "heldout.jsonl").read_text().splitlines()) == 3


def test_the_pairs_of_runs_kept_side_by_side_make_one_table_and_one_mean(tmp_path: Path, capsys) -> None:
    """One device call trains one seed's pair: ``pairs`` reads each run's results.json under --out
    and sets every pair in one table, ordered by seed, with the mean gap over all of them; a seed
    trained twice is counted as a pair, not as another seed; a last line says whether every run had
    the same rows (their recorded sha256) and names runs that differ; no runs at all is one clear line."""
    q = bench()

    def run(seed: int, ours: float, theirs: float) -> dict:
        argv = ["-m", "training", "train", f"--train.seed={seed}", f"--data.seed={seed}"]
        return {
            "fleet": {"argv": argv, "train_s": 60.0, "steps": 800, "at_step": {"800": 60.0}},
            "specforge": {"seed": seed, "train_s": 120.0, "steps": 800},
            "evals": {
                f"{arm}-800": {"arm": arm, "step": 800, "held_out": {"tau_mean": tau}}
                for arm, tau in (("fleet", ours), ("specforge", theirs))
            },
        }

    same = {"train.jsonl": "ab" * 32, "heldout.jsonl": "cd" * 32}
    for name, seed, ours, theirs in (("b", 5, 1.879, 1.930), ("a", 3, 1.950, 1.882), ("c", 3, 1.94, 1.9)):
        (tmp_path / name).mkdir()
        data = {"data": same} if name != "c" else {}  # c: a run from before the digests were kept
        (tmp_path / name / "results.json").write_text(json.dumps(run(seed, ours, theirs) | data))
    assert q.main(["pairs", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ")[0:5] for line in printed if line.startswith("| 3") or line.startswith("| 5")]
    assert rows == [
        ["| 3", "800", "1.950", "1.882", "+0.068"],
        ["| 3", "800", "1.940", "1.900", "+0.040"],
        ["| 5", "800", "1.879", "1.930", "-0.051"],
    ]
    assert printed[-3] == (
        "mean gap over 3 pairs (2 seeds): +0.019 (standard error 0.036); "
        "one-sided 95% lower bound -0.086 (t 2.920, 2 df)"
    )
    assert printed[-1] == (
        "data: identical in 2 runs (sha256 train abababababababab, held-out cdcdcdcdcdcdcdcd); "
        "not recorded in c"
    )
    assert (tmp_path / "pairs.md").read_text().splitlines()[-3:] == printed[-3:]
    other = json.loads((tmp_path / "b" / "results.json").read_text())
    other["data"] = {**same, "train.jsonl": "ef" * 32}  # b's rows regenerated otherwise
    (tmp_path / "b" / "results.json").write_text(json.dumps(other))
    assert q.main(["pairs", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "data: NOT the same in every run (train/held-out sha256: a abababababab/cdcdcdcdcdcd, "
        "b efefefefefef/cdcdcdcdcdcd): pair runs of one data set"
    )
    assert q.data_line({"old": {}, "older": {}}) == "data: no sha256 recorded in old, older"
    with pytest.raises(SystemExit, match=r"no \*/results\.json under"):
        q.main(["pairs", "--out", str(tmp_path / "none")])


def test_the_t_table_gives_95_percent_one_sided_at_each_degree_of_freedom() -> None:
    """Each tabled quantile, checked by integrating Student's t density (math.gamma, Simpson's rule):
    the probability under it is 0.95 to the table's three decimals."""
    import math

    q = bench()

    def cdf(t: float, df: int, n: int = 20000) -> float:
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        f = [c * (1 + (t * i / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        area = (t / n) / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
        return 0.5 + area

    for df, t in enumerate(q.T95, start=1):
        assert cdf(t - 0.0005, df) < 0.95 < cdf(t + 0.0005, df), (df, t)
