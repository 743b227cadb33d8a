"""benchmarks/magpie_bench.py on a CPU: every arm's data overrides are a valid smol-h200 config with
one lever changed, and the table reads the results as the arms write them."""

from __future__ import annotations

from testkit import benchmark_module


def bench():  # type: ignore[no-untyped-def]
    return benchmark_module("magpie_bench")


def test_each_arm_is_smol_h200_with_its_data_lever() -> None:
    from training.config import load_config
    from training.data.regen import source_counts

    m = bench()
    data = {name: load_config("smol-h200", m.arm_overrides(name, 3000)).data for name in m.ARMS}
    split = {
        name: source_counts(d.regen_prompts, d.regen_sources, d.magpie_share) for name, d in data.items()
    }
    assert split == {
        "base": (3000, 0),
        "magpie": (0, 3000),
        "mix25": (2250, 750),
        "mix50": (1500, 1500),
        "magpie-2x": (0, 6000),
        "mix50-2x": (3000, 3000),
    }
    assert {d.regen_max_new_tokens for d in data.values()} == {
        load_config("smol-h200").data.regen_max_new_tokens
    }


def test_the_pools_hold_what_the_arms_need_and_each_arm_draws_its_counts() -> None:
    """Today's pool at the most any arm takes (in slices when asked: every N-th prompt of the
    same list), Magpie's in shards of their own seeds; an arm's rows are its counts of each pool,
    the same for the same seed, and an arm the pools cannot fill is refused in one line."""
    import pytest

    m = bench()
    plan = m.pool_plan(["base", "mix25", "mix50"], 100, 2, base_shards=2)
    assert plan == {
        "base-0": ["--slice=0/2", "--data.regen_prompts=100", "--data.regen_sources=stdlib,packages"],
        "base-1": ["--slice=1/2", "--data.regen_prompts=100", "--data.regen_sources=stdlib,packages"],
        "magpie-0": ["--data.regen_prompts=25", "--data.regen_sources=magpie", "--data.magpie_seed=0"],
        "magpie-1": ["--data.regen_prompts=25", "--data.regen_sources=magpie", "--data.magpie_seed=1"],
    }
    assert list(m.pool_plan(["base"], 100, 2)) == ["base"]  # whole: the trainer's own cache key
    base = [{"messages": [{"role": "user", "content": f"b{i}"}]} for i in range(100)]
    magpie = [{"messages": [{"role": "user", "content": f"m{i}"}]} for i in range(50)]
    rows = m.arm_rows("mix25", 100, base, magpie, seed=3)
    prompts = [r["messages"][0]["content"] for r in rows]
    assert sum(p.startswith("b") for p in prompts) == 75 and sum(p.startswith("m") for p in prompts) == 25
    assert len(set(prompts)) == 100
    assert rows == m.arm_rows("mix25", 100, base, magpie, seed=3)
    with pytest.raises(SystemExit, match="arm magpie: needs 0 \\+ 100 rows, the pools hold 100 \\+ 50"):
        m.arm_rows("magpie", 100, base, magpie, seed=3)


def test_eval_figures_are_read_from_the_evaluators_output() -> None:
    """The lines and tables ``python -m training eval --export`` prints (copied from a run's log)."""
    m = bench()
    text = "\n".join(
        [
            "eval: evaluating acceptance (1 held_out prompts) 24/24 tokens (100%) in 48s, ETA 0s",
            "eval export /x/base (held_out): tau_mean=2.771 per round, 2.936 per prompt over 24 blocks of"
            " 1 prompts; hist=[24, 0] (48.8s); tree tau 16:3.40 64:3.95 (replay)",
            "budget    tau  tau/prompt  x chain  tree size",
            " chain  2.771       2.936    1.000           ",
            "    16  3.402       3.500    1.228       16.0",
            "    64  3.951       4.010    1.426       64.0",
            "eval export /x/base (general): tau_mean=1.680 per round, 1.700 per prompt over 48 blocks of"
            " 2 prompts; hist=[48, 0] (87.8s); tree tau 16:2.00 (replay)",
            "budget    tau  tau/prompt  x chain  tree size",
            " chain  1.680       1.700    1.000           ",
            "    16  2.004       2.100    1.193       16.0",
        ]
    )
    found = m.eval_figures(text, ["held_out", "general"])
    assert found["held_out"]["tau_mean"] == 2.771 and found["held_out"]["tau_prompt_mean"] == 2.936
    assert found["held_out"]["tree"] == {"16": 3.402, "64": 3.951}
    assert found["general"]["tau_mean"] == 1.68 and found["general"]["tree"] == {"16": 2.004}


def test_the_table_has_a_row_per_arm_failed_ones_too() -> None:
    m = bench()
    arms = {
        "mix25": {
            "overrides": [],
            "trained_rows": 95,
            "train": {"train_s": 61.2},
            "evals": {
                "held_out": {"tau_mean": 2.5, "tree": {"16": 3.1, "64": 3.6}},
                "general": {"tau_mean": 1.9},
            },
        },
        "gamma12": {
            "overrides": ["--drafter.gamma=12"],
            "trained_rows": 98,
            "train": {"train_s": 60.0},
            "evals": {"held_out": {"tau_mean": 2.4, "tree": {"16": 3.0}}},
        },
        "magpie": {"arm": "magpie", "error": "RegenError: no server"},
    }
    lines = m.table(arms, 100)
    assert lines[0].endswith("| tree 16 held-out | tree 64 held-out |")
    assert lines[2] == "| mix25 | 75 + 25 | - | 95 | 61 | 2.500 | 1.900 | 3.100 | 3.600 |"
    assert lines[3] == "| gamma12 | 100 + 0 | --drafter.gamma=12 | 98 | 60 | 2.400 | - | 3.000 | - |"
    assert lines[4].startswith("| magpie | failed: RegenError: no server")


def test_pools_for_an_unknown_arm_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`all --pools-for` as benchmarks/gpu/quality.sh passes it: parsed, and an arm it does not
    know refused before any pool is regenerated."""
    import pytest

    with pytest.raises(SystemExit, match=r"--pools-for: unknown arm 'mix99'"):
        bench().main(["all", "--out", str(tmp_path), "--arms", "base", "--pools-for", "mix99"])
    assert not list(tmp_path.glob("pool-*"))
