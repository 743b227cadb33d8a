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


def test_the_table_has_a_row_per_arm_failed_ones_too() -> None:
    m = bench()
    arms = {
        "mix25": {
            "overrides": m.arm_overrides("mix25", 100),
            "trained_rows": 95,
            "magpie": {"kept": 25, "sampled": 40, "filtered_share": 0.375},
            "train": {"train_s": 61.2},
            "evals": {"held_out": {"tau_mean": 2.5}, "general": {"tau_mean": 1.9}},
        },
        "magpie": {"arm": "magpie", "error": "RegenError: no server"},
    }
    lines = m.table(arms)
    assert lines[2] == (
        "| mix25 | stdlib,packages,magpie (0.25 Magpie) | 100 | 25 / 40 (37.5%) | 95 | 61 | 2.500 | 1.900 |"
    )
    assert lines[3].startswith("| magpie | failed: RegenError: no server")
