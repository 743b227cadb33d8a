"""benchmarks/tree_bench.py on a CPU: the cost command on the tiny target writes the curve with
its speedups and best budget; the levers' verdict and the taus' parsing by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from testkit import benchmark_module


def bench():  # type: ignore[no-untyped-def]
    return benchmark_module("tree_bench")


def test_the_verdict_and_the_taus_by_hand() -> None:
    tb = bench()
    assert tb.parse_taus("0=2.5, 64=3.9") == {0: 2.5, 64: 3.9}
    with pytest.raises(SystemExit, match="BUDGET=TAU"):
        tb.parse_taus("64:3.9")
    base, arm = {0: 2.50, 64: 3.00}, {0: 2.49, 64: 3.09}
    assert tb.verdict(base, arm, 64) == {
        "budget": 64, "tree_gain": pytest.approx(0.03), "chain_change": pytest.approx(-0.01), "ships": True,
    }  # fmt: skip
    assert not tb.verdict(base, {0: 2.47, 64: 3.5}, 64)["ships"]  # the chain fell by 0.03
    assert not tb.verdict(base, {0: 2.5, 64: 3.05}, 64)["ships"]  # +1.7%
    assert (
        tb.best_budget({0: 2.0, 16: 2.4, 64: 2.4}, None) == 16
    )  # no cost: the highest tau, then the cheaper


def test_cost_on_the_tiny_target_writes_the_curve(tmp_path: Path, monkeypatch, capsys) -> None:
    # the session's model cache (tests/conftest.py): the tiny model is built once a session
    monkeypatch.setenv("FLEET_TRAINING_CACHE", os.environ.get("FLEET_TEST_TRAINING_CACHE") or str(tmp_path))
    tb = bench()
    out = tmp_path / "cost.json"
    argv = ["cost", "--config", "tiny-cpu", "--device", "cpu", "--budgets", "0,16", "--repeats", "1"]
    argv += [
        "--warmup",
        "0",
        "--context",
        "24",
        "--taus",
        "0=1.5,16=2.0",
        "--out",
        str(out),
        "--train.torch_threads=1",
    ]
    assert tb.main(argv) == 0
    body = json.loads(out.read_text())
    (cost,) = body["costs"]
    assert body["config"] == "tiny-cpu" and body["tau_meaningful"] and not body["hybrid"]
    assert cost["context"] == 24 and set(cost["t_verify_s"]) == set(cost["speedup"]) == {"0", "16"}
    assert cost["best_budget"] in (0, 16) and set(cost["beat_chain_ratio"]) == {"0", "16"}
    assert "<- best" in capsys.readouterr().out
