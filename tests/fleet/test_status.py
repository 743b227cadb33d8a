"""The status model: states and transitions, tolerant parsing, the user's bucket table, JSON."""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from invoke import Context
from invoke.exceptions import Exit
from testkit import framed

from fleet import remote
from fleet.errors import ConfigError, RunError
from fleet.gpus import parse_query_gpu
from fleet.status.fetch import fetch_argv, gpu_rows_from_csv, parse_fetch, status_from_path
from fleet.status.model import STATE_EXIT_CODES, RunFacts, build_status
from fleet.status.render import render_text, watch_interval, watch_live
from training.contract import parse_bucket_table, parse_events, validate_event

REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / "tests" / "fixtures" / "logs"
T0 = 1_764_460_000.0

# the user's start-up log (tests/fixtures/logs/startup_fieldnotes.log): exactly these numbers
FIELD_NOTES_TABLE = (
    46688,
    2,
    64,
    19.3,
    [
        (0, 0, 770, 2120, 4.5),
        (1, 770, 1216, 4016, 8.6),
        (2, 1216, 1728, 5470, 11.7),
        (3, 1728, 2432, 7493, 16.0),
        (4, 2432, 3296, 8009, 17.2),
        (5, 3296, 8193, 19580, 41.9),
    ],
)


def ev(ts: float, event: str, rank: int = 0, role: str = "single", **fields: Any) -> str:
    obj = {"v": 1, "ts": T0 + ts, "event": event, "rank": rank, "role": role, **fields}
    assert validate_event(obj) == [], validate_event(obj)  # fixtures follow the real contract
    return json.dumps(obj)


def step(
    ts: float, n: int, loss: float = 3.0, rank: int = 0, role: str = "single", rate: float = 1000.0
) -> str:
    return ev(
        ts, "step", rank, role, step=n, total_steps=100, epoch=0, loss=loss, acc=[0.5, 0.3], tau=1.8,
        lr=1e-4, tokens_per_s=rate, grad_norm=1.0, mem_gib=0.0,
    )  # fmt: skip


def lines(*items: str) -> str:
    return "\n".join(items) + "\n"


START = [ev(0, "run_start", config="tiny-cpu", run_dir="/r", pid=1, host="h", world_size=1, device="cpu")]
ALIVE = RunFacts(run_id="r1", alive=True, now=T0 + 60)


def status(events: list[str], facts: RunFacts = ALIVE, log: str = "", **kw: Any):
    return build_status("t", facts, lines(*events) if events else "", log, **kw)


# --------------------------------------------------------------------------- bucket table


def _assert_field_notes_table(table: Any) -> None:
    assert table is not None
    total, lo, hi, avg, rows = FIELD_NOTES_TABLE
    assert (table.batches_per_epoch, table.min, table.max, table.avg) == (total, lo, hi, avg)
    assert [(b.index, b.lo, b.hi, b.batches, b.percent) for b in table.buckets] == rows


def test_bucket_table_from_the_startup_log_fixture() -> None:
    _assert_field_notes_table(parse_bucket_table((LOGS / "startup_fieldnotes.log").read_text()))


def test_bucket_table_with_rank_prefixes_and_crlf() -> None:
    text = (LOGS / "startup_fieldnotes.log").read_text().replace("\n", "\r\n")
    text = "\n".join(f"[rank0]:{line}" for line in text.split("\n"))
    _assert_field_notes_table(parse_bucket_table(text))


def test_load_progress_k_of_n_from_the_human_log() -> None:
    st = status([], RunFacts(alive=True), log=(LOGS / "startup_fieldnotes.log").read_text())
    assert st.load is not None and (st.load.what, st.load.done, st.load.total) == ("target", 2, 5)
    assert st.buckets is not None and st.buckets.batches_per_epoch == 46688


# --------------------------------------------------------------------------- states


@pytest.mark.parametrize(
    ("phase", "state"),
    [
        ("load_data", "loading"),
        ("buckets", "loading"),
        ("load_target", "loading"),
        ("load_drafter", "loading"),
        ("compile", "compiling"),
        ("train", "training"),
        ("eval", "evaluating"),
        ("checkpoint", "checkpointing"),
    ],
)
def test_live_phases(phase: str, state: str) -> None:
    st = status([*START, ev(10, "phase", phase=phase)])
    assert (st.state, st.phase, st.exit_code) == (state, phase, 0)
    assert st.since == T0 + 10


def test_starting_before_any_event() -> None:
    st = status([])
    assert st.state == "starting" and st.exit_code == 0


def test_transitions_through_a_whole_run() -> None:
    run = [
        *START,
        ev(1, "phase", phase="load_data"),
        ev(2, "phase", phase="compile"),
        ev(3, "phase", phase="train"),
        step(4, 1),
        ev(5, "phase", phase="checkpoint"),
        ev(6, "checkpoint", step=1, path="/r/ckpt", seconds=0.5),
        ev(7, "phase", phase="train"),
        step(8, 2),
        ev(9, "phase", phase="eval"),
        ev(10, "eval", step=2, tau_mean=1.5, tau_hist=[0, 1], tau_estimate=1.7, tau_prompt_mean=1.25),
        ev(11, "phase", phase="done"),
        ev(12, "done", steps=2, seconds=12.0),
    ]
    seen = []
    for n in range(len(run) + 1):
        st = status(run[:n], RunFacts(alive=True, now=T0 + 13))
        if not seen or seen[-1] != st.state:
            seen.append(st.state)
    # done, while its process still exits: the run is not finished yet
    assert seen == ["starting", "loading", "compiling", "training", "checkpointing", "training", "evaluating"]
    ended = status(run, RunFacts(alive=False, exit_code=0, now=T0 + 20))
    assert (ended.state, ended.exit_code, ended.eta_s) == ("finished", 0, None)
    assert ended.last_checkpoint is not None and ended.last_checkpoint.step == 1
    assert (ended.eval_tau, ended.eval_tau_prompt) == (1.5, 1.25)


def test_each_eval_set_last_tau_in_text_and_json() -> None:
    """Two evals of two sets (eval.sets), after events from before `set` (split alone, neither):
    each set's last figure, the held-out one as eval_tau; the memorisation check's is named."""
    fig = {"tau_hist": [0, 1], "tau_estimate": 1.7}
    run = [
        *START,
        step(1, 1),
        ev(2, "eval", step=1, tau_mean=1.2, **fig),  # no set, no split: held_out
        ev(3, "eval", step=1, split="train", tau_mean=3.1, **fig),
        step(4, 2),
        ev(5, "eval", step=2, set="held_out", split="held_out", tau_mean=2.8, tau_prompt_mean=2.9, **fig),
        ev(6, "eval", step=2, set="general", split="general", tau_mean=1.68, tau_prompt_mean=1.7, **fig),
    ]
    st = status(run)
    assert [(f.set, f.step, f.tau_mean) for f in st.evals] == [
        ("held_out", 2, 2.8),
        ("train", 1, 3.1),
        ("general", 2, 1.68),
    ]
    assert (st.eval_tau, st.eval_tau_prompt) == (2.8, 2.9)
    text = render_text(st, now=T0 + 7, width=200)
    assert "eval 2.800 held_out, 3.100 train, 1.680 general per round" in text, text
    data = json.loads(json.dumps(st.to_json(), allow_nan=False))
    assert [(e["set"], e["tau_mean"]) for e in data["evals"]] == [
        ("held_out", 2.8),
        ("train", 3.1),
        ("general", 1.68),
    ]
    assert data["eval_tau"] == 2.8
    only_general = status([*START, step(1, 1), run[-1]])  # eval.sets = general: no held-out figure
    assert only_general.eval_tau is None and [f.set for f in only_general.evals] == ["general"]
    assert "eval 1.680 general per round (1.700 per prompt)" in render_text(only_general, now=T0 + 7)


def test_a_serve_bench_after_the_run_is_a_line_and_keeps_it_finished() -> None:
    run = [
        *START,
        ev(1, "phase", phase="train"),
        step(2, 1),
        ev(3, "phase", phase="done"),
        ev(4, "done", steps=1, seconds=1.0),
    ]
    bench = {
        "step": 1,
        "prompts": 16,
        "backend": "cuda",
        "draft_lengths": [0, 3, 15],
        "tok_s": [400.0, 700.0, 650.0],
        "mean_len": [1.0, 2.0, 2.3],
        "accept_rate": [0.0, 0.33, 0.09],
        "identical": [16, 16, 15],
        "best_draft": 3,
        "best_speedup": 1.75,
        "engine_tau": 2.3,
        "project_tau": 2.25,
    }
    st = status([*run, ev(5, "serve_bench", **bench)], RunFacts(alive=False, exit_code=0, now=T0 + 20))
    assert st.state == "finished" and st.serve is not None
    assert st.serve.text() == (
        "llama.cpp cuda: 1.75x at draft 3 (400 -> 700 tok/s), 2.30 per round (eval tau 2.25), "
        "greedy DIFFER on 16 prompts"
    )
    assert status(run, RunFacts(alive=False, exit_code=0, now=T0 + 20)).serve is None


TREE_EVAL = {
    "step": 3, "tau_mean": 2.5, "tau_hist": [1, 1, 2], "tau_estimate": 2.7, "tau_prompt_mean": 2.4,
    "tree": [
        {"budget": b, "tau_mean": t, "tau_prompt_mean": t, "hist": [0, 1], "rounds": 9, "tree_size_mean": b}
        for b, t in ((16, 3.1), (64, 3.55), (128, 3.8))
    ],
    "tree_cost": {
        "device": "NVIDIA H100 80GB HBM3", "context": 320, "t_step_s": 0.012, "t_draft_s": 0.004,
        "t_verify_s": {"0": 0.013, "16": 0.013, "64": 0.014, "128": 0.016},
        "speedup": {"0": 1.76, "16": 2.19, "64": 2.36, "128": 2.4}, "best_budget": 128, "best_speedup": 2.4,
        "model": "modelled",
    },
}  # fmt: skip


def test_the_last_evals_tree_figures_are_one_line_and_in_the_json() -> None:
    run = [*START, ev(1, "phase", phase="train"), step(2, 3), ev(3, "eval", **TREE_EVAL)]
    st = status(run, RunFacts(alive=True, now=T0 + 4))
    line = "tree tau 3.55 @64, 1.42x chain; best budget 128: ~2.40x speedup modelled (NVIDIA H100 80GB HBM3)"
    assert st.tree is not None and st.tree.text() == line
    assert line in render_text(st, now=T0 + 4, width=200)
    data = json.loads(json.dumps(st.to_json(), allow_nan=False))
    assert data["tree"]["taus"] == {"0": 2.5, "16": 3.1, "64": 3.55, "128": 3.8}
    assert (data["tree"]["best_budget"], data["tree"]["shown_budget"], data["tree"]["text"]) == (
        128,
        128,
        line,
    )
    # no cost measured (a CPU eval): the tau at 64, no speedup; a later eval without a tree clears it
    plain = {k: v for k, v in TREE_EVAL.items() if k != "tree_cost"}
    st = status([*run[:-1], ev(3, "eval", **plain)], RunFacts(alive=True, now=T0 + 4))
    assert st.tree is not None and st.tree.text() == "tree tau 3.55 @64, 1.42x chain"
    chain_only = {k: v for k, v in plain.items() if k != "tree"}
    st = status([*run, ev(4, "eval", **chain_only)], RunFacts(alive=True, now=T0 + 5))
    assert st.tree is None and st.to_json()["tree"] is None and "tree" not in render_text(st, now=T0 + 5)


def test_exit_codes_are_distinct_for_unhealthy_states() -> None:
    bad = [STATE_EXIT_CODES[s] for s in ("stopped", "stalled", "failed")]
    assert len(set(bad)) == 3 and 0 not in bad
    assert all(code not in range(1, 8) for code in bad)  # fleet.errors owns 1-7


def test_killed_run_is_failed_with_its_exit_status() -> None:
    st = status([*START, ev(1, "phase", phase="train"), step(2, 1)], RunFacts(alive=False, exit_code=137))
    assert (st.state, st.process_exit_code, st.exit_code) == ("failed", 137, 12)
    assert any("137" in n for n in st.notes)


def test_process_gone_without_exit_status_is_failed() -> None:
    st = status([*START, ev(1, "phase", phase="train")], RunFacts(alive=False))
    assert st.state == "failed"


def test_stopped_by_sigterm() -> None:
    st = status([*START, ev(1, "phase", phase="stopped")], RunFacts(alive=False, exit_code=0))
    assert (st.state, st.exit_code) == ("stopped", 10)


def test_error_event_on_one_rank_fails_the_run() -> None:
    events = [
        step(1, 1, rank=0, role="drafter"),
        step(1, 1, rank=1, role="drafter"),
        ev(2, "error", rank=1, role="drafter", type="OutOfMemoryError",
           message="CUDA out of memory. Tried to allocate 300.00 GiB.", traceback_tail=""),
        ev(2.1, "phase", rank=1, role="drafter", phase="error"),
        step(3, 2, rank=0, role="drafter"),
    ]  # fmt: skip
    st = status(events, RunFacts(run_id="r1", alive=False, exit_code=1, now=T0 + 60))
    assert st.state == "failed" and st.last_error is not None
    assert st.last_error.type == "OutOfMemoryError"
    assert [d.signature for d in st.diagnosis] == ["cuda-oom"]
    # A process of the run still lives (rank 0 trains on): not ended yet, the error shown all the same.
    live = status(events)
    assert (live.state, live.exit_code, live.phase) == ("training", 0, "train")
    assert live.last_error == st.last_error and "the run reported error" in " ".join(live.notes)


def test_done_counts_only_when_every_rank_is_done() -> None:
    starts = [
        ev(
            0,
            "run_start",
            r,
            "drafter",
            config="c",
            run_dir="/r",
            pid=r,
            host="h",
            world_size=2,
            device="cpu",
        )
        for r in (0, 1)
    ]
    one_done = [
        *starts,
        ev(1, "phase", 0, "drafter", phase="train"),
        ev(2, "phase", 1, "drafter", phase="train"),
        ev(3, "phase", 0, "drafter", phase="done"),
    ]
    assert status(one_done).state == "training"
    both = [*one_done, ev(4, "phase", 1, "drafter", phase="done")]
    assert status(both, RunFacts(alive=False, exit_code=0)).state == "finished"
    assert status(both).state == "training"  # still exiting


def test_stalled_when_alive_but_nothing_moves() -> None:
    events = [*START, ev(1, "phase", phase="train"), step(2, 1)]
    quiet = RunFacts(alive=True, now=T0 + 1000, log_mtime=T0 + 2, events_mtime=T0 + 2)
    st = status(events, quiet, stall_window_s=600)
    assert (st.state, st.exit_code, st.since) == ("stalled", 11, T0 + 2)
    # the log still growing (e.g. a progress bar) is progress: not stalled
    growing = RunFacts(alive=True, now=T0 + 1000, log_mtime=T0 + 990, events_mtime=T0 + 2)
    assert status(events, growing, stall_window_s=600).state == "training"
    # within the window: not stalled
    assert status(events, quiet, stall_window_s=5000).state == "training"


def test_an_ended_run_is_never_stalled_and_a_live_one_never_ended() -> None:
    events = [*START, ev(1, "phase", phase="train"), ev(2, "phase", phase="done")]
    st = status(events, RunFacts(alive=False, exit_code=0, now=T0 + 10_000), stall_window_s=1)
    assert st.state == "finished"
    # done, but its process never exits: it hangs, and that is no finished run
    hung = status(events, RunFacts(alive=True, now=T0 + 10_000), stall_window_s=1)
    assert (hung.state, hung.exit_code) == ("stalled", 11)


def test_offline_log_ending_in_a_traceback_is_failed() -> None:
    st = status_from_path(LOGS / "generic_traceback.log")
    assert st.state == "failed" and st.last_error is not None and st.last_error.type == "KeyError"


# --------------------------------------------------------------------------- numbers


def test_steps_loss_trend_eta_and_rates_per_role() -> None:
    events = [*START]
    for n in range(1, 21):
        events.append(step(10 * n, n, loss=5.0 - 0.1 * n, rank=0, role="drafter", rate=7000.0))
        events.append(
            ev(
                10 * n + 1,
                "balance",
                1,
                "target",
                window_s=10.0,
                busy_s=6.0,
                wait_s=4.0,
                tokens_per_s=20000.0,
            )
        )
        events.append(step(10 * n + 2, n, loss=9.9, rank=2, role="drafter", rate=6000.0))
    st = status(events, RunFacts(alive=True, now=T0 + 205))
    assert (st.step, st.total_steps, st.epoch) == (20, 100, 0)
    assert st.loss == pytest.approx(3.0)  # rank 0's steps, not rank 2's
    assert st.loss_trend is not None and st.loss_trend < 0
    assert st.eta_s == pytest.approx(80 * 10.0)  # 10 s per step, 80 steps left
    assert st.tokens_per_s == pytest.approx(13000.0)
    assert dict(st.tokens_per_s_by_role) == {"drafter": 13000.0, "target": 20000.0}


def test_compile_cache_warm_start_with_misses_is_flagged() -> None:
    cache = {"fxgraph_hit": 10, "fxgraph_miss": 2, "aotautograd_hit": 10, "aotautograd_miss": 0}
    st = status([*START, ev(1, "compile_cache", **cache)])
    assert st.compile_cache is not None and st.compile_cache.warm_with_misses
    assert any("warm compile cache" in n for n in st.notes)
    cold = {"fxgraph_hit": 0, "fxgraph_miss": 12, "aotautograd_hit": 0, "aotautograd_miss": 12}
    assert not status([*START, ev(1, "compile_cache", **cold)]).compile_cache.warm_with_misses


def target_event(ts: float, rank: int, delta_rule: str, linear: int = 48) -> str:
    kernels = {"delta_rule": delta_rule, "conv1d": "torch", "gated_norm": "torch"} if linear else {}
    fast = ("yes" if delta_rule != "torch" else "no") if linear else "n/a"
    return ev(
        ts, "target", rank, "target", model_type="qwen3_5_text" if linear else "qwen3", num_layers=64,
        layer_ids=[1, 16, 31, 46, 61], linear_layers=linear, kernels=kernels, fast_path=fast,
    )  # fmt: skip


def test_target_kernels_per_rank_are_shown_and_a_fallback_rank_is_noted() -> None:
    events = [*START, *(target_event(1, r, "fla") for r in range(4)), target_event(1, 4, "torch")]
    st = status([*events, ev(2, "phase", phase="train")])
    assert [t.rank for t in st.targets] == [0, 1, 2, 3, 4]
    assert st.targets[0].kernels == {"delta_rule": "fla", "conv1d": "torch", "gated_norm": "torch"}
    assert [note for note in st.notes if "torch fallback" in note] == [
        "target rank(s) 4 run the linear-attention torch fallback (~1.5x slower): the env lacks fla-core "
        "(envs/train pins it)"
    ]
    text = render_text(st, now=T0 + 3, width=200)
    assert (
        "qwen3_5_text, 48 linear-attention layers: fast path yes (delta_rule fla, conv1d torch, gated_norm "
        "torch)  (ranks 0-3)" in text
    )
    assert "fast path no (delta_rule torch, conv1d torch, gated_norm torch)  (rank 4)" in text
    data = st.to_json()
    assert data["targets"][4] == {
        "rank": 4,
        "model_type": "qwen3_5_text",
        "linear_layers": 48,
        "kernels": {"delta_rule": "torch", "conv1d": "torch", "gated_norm": "torch"},
        "fast_path": "no",
    }
    dense = status([*START, target_event(1, 0, "", linear=0)])
    assert dense.targets[0].fast_path == "n/a" and "fast path" not in render_text(dense, now=T0 + 3)
    assert not any("fallback" in n for n in dense.notes)


# --------------------------------------------------------------------------- tolerant parsing


def test_truncated_torn_nul_and_foreign_lines_are_skipped() -> None:
    good = [*START, ev(1, "phase", phase="train"), step(2, 7)]
    text = '"rank": 0, "event": "step"}\n' + "\n".join(good) + "\n\x00\x00garbage\n"
    text += json.dumps({"v": 2, "ts": T0, "event": "step"}) + "\n" + good[-1][:25]
    parsed = parse_events(text, truncated=True)
    assert len(parsed.events) == 3 and parsed.skipped == 3
    st = build_status("t", ALIVE, text, "", events_truncated=True)
    assert st.step == 7 and st.state == "training"
    assert any("skipped" in n for n in st.notes)


def test_nan_loss_is_null_in_json() -> None:
    st = status([*START, step(1, 1, loss=math.nan)])
    data = json.loads(json.dumps(st.to_json(), allow_nan=False))
    assert data["loss"] is None


def test_json_has_the_documented_keys() -> None:
    log = (LOGS / "recompile_limit.log").read_text()
    data = status([*START, step(1, 1)], RunFacts(alive=False, exit_code=1), log=log).to_json()
    for key in (
        "state",
        "phase",
        "step",
        "loss",
        "tokens_per_s",
        "diagnosis",
        "exit_code",
        "buckets",
        "eta_s",
    ):
        assert key in data
    assert data["state"] == "failed" and data["exit_code"] == 12
    assert [set(d) >= {"cause", "fix"} for d in data["diagnosis"]] == [True, True]
    json.dumps(data, allow_nan=False)


def test_text_shows_the_picture() -> None:
    events = [*START, ev(1, "phase", phase="train"), step(2, 5)]
    st = status(events, RunFacts(run_id="r1", release="20261130T000000Z-abc1234", alive=True, now=T0 + 3),
                log=(LOGS / "startup_fieldnotes.log").read_text())  # fmt: skip
    text = render_text(st, now=T0 + 3)
    for part in ("r1", "20261130T000000Z-abc1234", "training", "5/100", "Batches per epoch: 46688", "19580"):
        assert part in text


# --------------------------------------------------------------------------- fetch + --log


def test_fetch_script_on_a_real_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "20261130T000000Z-tiny-cpu"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(run.name)
    (run / "run.json").write_text(json.dumps({"release_id": "20261130T000000Z-abc1234"}))
    (run / "exit_code").write_text("137\n")
    big = lines(*START, ev(1, "phase", phase="train"), *(step(2 + i, i + 1) for i in range(400)))
    (run / "events.jsonl").write_text(big)
    (run / "train.log").write_text("x" * 5000 + "\n" + (LOGS / "cuda_oom.log").read_text())
    argv = fetch_argv(str(tmp_path), "/nonexistent/tmux", "", tail_bytes=4096)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    got = parse_fetch(out, tail_bytes=4096)
    assert got.facts.run_id == run.name and got.facts.exit_code == 137 and got.facts.alive is False
    assert got.facts.release == "20261130T000000Z-abc1234"
    assert got.events_truncated and len(got.events_text.encode()) <= 4096
    st = build_status("t", got.facts, got.events_text, got.log_text, events_truncated=True)
    assert st.state == "failed" and st.step == 400
    assert [d.signature for d in st.diagnosis] == ["cuda-oom", "sigkill"]  # exit 137: named last


def test_fetch_with_no_run_and_a_cut_answer(tmp_path: Path) -> None:
    argv = fetch_argv(str(tmp_path), "tmux", "")
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert parse_fetch(out).facts.run_id == ""
    with pytest.raises(RunError):
        parse_fetch(out.split("@@fleet end")[0])


def test_fetch_script_takes_paths_as_arguments_only(tmp_path: Path) -> None:
    workdir = tmp_path / "w $(touch PWNED1); touch PWNED2 `touch PWNED3`"
    run = workdir / "runs" / "r1"
    run.mkdir(parents=True)
    (workdir / "runs" / "latest").symlink_to("r1")
    (run / "events.jsonl").write_text(lines(*START))
    argv = fetch_argv(str(workdir), "tmux", "")
    assert argv[:3] == ["sh", "-c", remote.script("status_fetch.sh")] and str(workdir) in argv[4:]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert parse_fetch(out).facts.run_id == "r1"
    assert not list(tmp_path.glob("PWNED*"))


def test_gpu_rows_with_roles_from_the_recorded_nvidia_smi() -> None:
    text = (REPO / "tests" / "fixtures" / "nvidia-smi" / "h200x2" / "query_busy.csv").read_text()
    rows = gpu_rows_from_csv(text, targets=1)
    assert [(g.index, g.role, g.memory_used_mib, g.memory_total_mib) for g in rows] == [
        (0, "target", 8719, 143771),
        (1, "drafter", 4, 143771),
    ]


def test_log_path_run_dir_events_file_and_missing(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(lines(*START, ev(1, "phase", phase="compile")))
    (tmp_path / "train.log").write_text((LOGS / "startup_fieldnotes.log").read_text())
    st = status_from_path(tmp_path)
    assert st.state == "compiling" and st.buckets is not None
    assert status_from_path(tmp_path / "events.jsonl").state == "compiling"
    with pytest.raises(ConfigError):
        status_from_path(tmp_path / "nope")


# --------------------------------------------------------------------------- the task, --watch


def test_watch_refreshes_in_place_until_the_run_is_final() -> None:
    answers = [
        status([*START, ev(1, "phase", phase="train"), step(2, 1)]),
        status([*START, ev(1, "phase", phase="train"), step(2, 2)]),
        status([*START, ev(1, "phase", phase="done")], RunFacts(alive=False, exit_code=0)),
    ]
    calls = []

    def get():
        calls.append(1)
        return answers[len(calls) - 1]

    assert watch_live(get, 0.01).state == "finished"
    assert len(calls) == 3


@pytest.mark.parametrize(("value", "seconds"), [(None, None), (True, 5.0), ("", 5.0), ("2.5", 2.5)])
def test_watch_interval(value: Any, seconds: float | None) -> None:
    assert watch_interval(value) == seconds


@pytest.mark.parametrize("value", ["abc", "0", "-1", "99999"])
def test_bad_watch_interval_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="--watch"):
        watch_interval(value)


def test_task_with_log_prints_json_and_returns_the_state_code(capsys: pytest.CaptureFixture[str]) -> None:
    from tasks import status as status_task

    with pytest.raises(Exit) as exited:
        status_task(Context(), json=True, log=str(LOGS / "nccl_timeout.log"))
    code = exited.value.code
    data = json.loads(capsys.readouterr().out)
    assert code == data["exit_code"] == 12 and data["state"] == "failed"
    assert [d["signature"] for d in data["diagnosis"]] == ["nccl-timeout", "rank-died"]


def test_fab_status_on_the_local_target_with_real_tmux(local_tmux: Any, tmp_path: Path) -> None:
    """deploy + train the selftest on the local target, then `fab status --json` until finished."""
    from testkit import fab, render_inventory

    target = {
        "host": "local",
        "workdir": str(tmp_path / "wd"),
        "gpus": 0,
        "env": "",
        "run": {"module": "training.selftest", "config": "selftest", "overrides": ["--selftest.steps=6",
                "--selftest.step_seconds=0.2"], "env": {}},
        "commands": {"python": str(REPO / ".venv" / "bin" / "python")},
    }  # fmt: skip
    config = tmp_path / "fleet.toml"
    config.write_text(render_inventory({"loc": target}, "loc"))
    env = {"TMUX_TMPDIR": str(local_tmux.socket_dir)}
    for args in (["deploy"], ["train"]):
        result = fab(*args, config=config, env=env)
        assert result.returncode == 0, result.stderr
    seen: list[str] = []
    for _ in range(200):  # a generous bound on polls, not a timing
        result = fab("status", "--json", config=config, env=env, in_process=True)  # polls: no start-up
        data = json.loads(result.stdout)
        seen.append(data["state"])
        if data["state"] == "finished":
            break
        time.sleep(0.3)
    assert seen[-1] == "finished" and result.returncode == 0
    assert data["step"] == 6 and data["run_id"] and data["release"]
    text = fab("status", config=config, env=env)
    assert "finished" in text.stdout and "6/6" in text.stdout


def test_fetch_status_on_a_local_target_with_the_nvidia_smi_shim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real fetch through a LocalTarget: GPU rows come from the shim, roles from the topology."""
    from fleet.inventory import Commands, TargetSpec, Topology
    from fleet.status.fetch import fetch_status
    from fleet.target import open_target

    fixture = REPO / "tests" / "fixtures" / "nvidia-smi" / "busy"
    monkeypatch.setenv("FLEET_NVSMI_FIXTURE_DIR", str(fixture))
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))  # no tmux server there: the pane is gone
    run = tmp_path / "wd" / "runs" / "r1"
    run.mkdir(parents=True)
    (tmp_path / "wd" / "runs" / "latest").symlink_to("r1")
    (run / "events.jsonl").write_text(lines(*START, ev(1, "phase", phase="train"), step(2, 3)))
    (run / "exit_code").write_text("1\n")
    (run / "train.log").write_text((LOGS / "nccl_timeout.log").read_text())
    expected = parse_query_gpu((fixture / "query.csv").read_text()).gpus
    spec = TargetSpec(
        name="gpu-local",
        host="local",
        workdir=str(tmp_path / "wd"),
        commands=Commands(nvidia_smi=str(REPO / "tests" / "shims" / "nvidia-smi")),
        gpus=len(expected),
        topology=Topology(1, len(expected) - 1),
    )
    with open_target(spec) as target:
        st = fetch_status(target)
    assert (st.state, st.process_exit_code, st.step) == ("failed", 1, 3)
    assert [(g.index, g.role, g.memory_used_mib) for g in st.gpus] == [
        (g.index, "target" if g.index == 0 else "drafter", g.memory_used_mib) for g in expected
    ]
    assert [d.signature for d in st.diagnosis] == ["nccl-timeout", "rank-died"]


def test_all_targets_table_has_one_row_per_target() -> None:
    import io

    from rich.console import Console

    from fleet.status.render import summary_table

    ok = status([*START, ev(1, "phase", phase="train"), step(2, 4)])
    rows = [("a", ok), ("b", RunError("b: no run under /w/runs: start one with `fab train`"))]
    console = Console(file=io.StringIO(), width=150, color_system=None)
    console.print(summary_table(rows))
    out = console.file.getvalue()
    assert "training" in out and "4/100" in out and "no run under /w/runs" in out


# --------------------------------------------------------------------------- a log alone, never, kernel


@pytest.mark.parametrize(
    ("log", "signature"),
    [
        ("cpp_abort.log", "cpp-abort"),
        ("dynamo_unsupported.log", "python-traceback"),
        ("disk_full.log", "disk-full"),
        ("rendezvous_timeout.log", "rendezvous"),
    ],
)
def test_fab_status_log_alone_ending_in_a_fatal_error_is_failed(
    tmp_path: Path, log: str, signature: str
) -> None:
    """`fab status --log FILE`: no events, no process facts; a log whose tail is fatal has failed."""
    from testkit import fab

    config = tmp_path / "fleet.toml"
    config.write_text('[targets.x]\nhost = "local"\nworkdir = "w"\n')
    result = fab("status", "--json", "--log", str(LOGS / log), config=config, in_process=True)
    assert result.returncode == 12, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["state"] == "failed" and [d["signature"] for d in data["diagnosis"]] == [signature]


def test_a_log_with_only_warnings_is_not_failed() -> None:
    for name in ("flex_dense.log", "nvml_mismatch.log"):
        st = status_from_path(LOGS / name)
        assert st.state == "starting" and st.diagnosis, name  # diagnosed, but nothing says it died


def test_never_status_is_a_state_with_exit_0() -> None:
    from fleet.status.fetch import never_status

    st = never_status("t", "/w")
    assert (st.state, st.exit_code, st.final, st.run_id) == ("never", 0, True, "")
    assert st.to_json()["state"] == "never" and "fab train" in st.notes[0]
    assert "never" in render_text(st)


def test_parse_kernel_log_keeps_oom_lines_of_the_run_window() -> None:
    from fleet.status.fetch import parse_kernel_log

    # clock 1000000 with uptime 5000 s: boot at 995000; a line at 4000.5 s is at 999000.5
    text = (
        "1000000 5000.00\n"
        "[ 1000.000000] Out of memory: Killed process 11 (python3) total-vm:1kB\n"
        "[ 4000.500000] oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=42,uid=0\n"
        "[ 4000.600000] Out of memory: Killed process 42 (python3) total-vm:9kB\n"
    )
    readable, lines = parse_kernel_log(text, since=998000.0, until=999500.0)
    assert readable and lines == (
        "oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=42,uid=0",
        "Out of memory: Killed process 42 (python3) total-vm:9kB",
    )
    assert parse_kernel_log("1000000 5000.00\nunreadable\n", None, None) == (False, ())
    assert parse_kernel_log("", None, None) == (False, ())


def test_a_pane_that_is_not_the_runs_lends_it_nothing() -> None:
    """The session's dead pane belongs to another run (pid differs): its status is not this run's."""

    def out(pid: str) -> str:
        parts = (("now", "100"), ("run", "r2"), ("pane", "1 3 0 777"), ("pid", pid), ("end", ""))
        return framed(*((name, 0, body) for name, body in parts))

    facts = parse_fetch(out("555")).facts
    assert (facts.alive, facts.exit_code) == (False, None)
    facts = parse_fetch(out("777")).facts
    assert (facts.alive, facts.exit_code) == (False, 3)


# --------------------------------------------------------------------------- launches of one run dir


def resume_ev(ts: float, n: int, rank: int = 0, role: str = "single") -> str:
    return ev(ts, "resume", rank, role, step=n, path=f"/r/checkpoints/step-{n:08d}.pt")


def checkpoint_ev(ts: float, n: int, seconds: float) -> str:
    return ev(ts, "checkpoint", step=n, path=f"/r/checkpoints/step-{n:08d}.pt", seconds=seconds)


def test_a_resumed_run_is_one_history_with_the_live_launchs_speed_and_eta() -> None:
    """Launch 1 logs steps 1..35 (checkpoint at 20) and is killed; launch 2 resumes at 20 and redoes
    21..35 at another speed: steps counted once, the redone values win, speed and ETA are launch 2's."""
    first = [step(i, i, loss=10.0 - i / 10, rate=1000.0) for i in range(1, 36)]
    first.insert(20, checkpoint_ev(20.5, 20, 0.5))
    relaunch = START[0].replace(f'"ts": {T0}', f'"ts": {T0 + 100}')
    second = [relaunch, resume_ev(101, 20)]
    second += [
        step(100 + 2 * (i - 20), i, loss=5.0, rate=2000.0 + (50.0 if i == 21 else 0)) for i in range(21, 41)
    ]
    second.append(checkpoint_ev(141, 40, 1.5))
    st = status([*START, *first, *second], RunFacts(run_id="r1", alive=True, now=T0 + 141))
    assert [s for s, _ in st.history] == list(range(1, 41))
    assert dict(st.history)[21] == 5.0 and dict(st.history)[20] == pytest.approx(8.0)
    assert (st.segments, st.resumed_from, st.step) == (2, 20, 40)
    assert st.tokens_per_s == 2000.0  # median of launch 2's windows; launch 1's 1000s do not count
    assert st.eta_s == pytest.approx(60 * 2.0)  # 2 s per step in launch 2, 60 steps left
    assert st.checkpoint_s == pytest.approx(1.0)  # median of 0.5 and 1.5
    data = st.to_json()
    steps = [h["step"] for h in data["history"]]
    assert steps == sorted(set(steps)) and data["segments"] == 2
    assert "resumed from step 20" in render_text(st) and "checkpoint time" in render_text(st)


def test_a_relaunch_without_resume_event_starts_its_history_over() -> None:
    """A launch that found no checkpoint redoes steps from 1: its steps replace the earlier ones."""
    first = [step(i, i, loss=9.0) for i in range(1, 6)]
    second = [step(10 + i, i, loss=4.0) for i in range(1, 4)]
    st = status([*START, *first, *START, *second])
    assert st.history == ((1, 4.0), (2, 4.0), (3, 4.0))


def test_median_tokens_per_s_ignores_a_slow_first_window() -> None:
    rates = [50.0, 1000.0, 1010.0, 990.0, 1005.0]
    st = status([*START, *(step(i, i, rate=r) for i, r in enumerate(rates, start=1))])
    assert st.tokens_per_s == 1000.0


def test_a_checkpoint_set_aside_at_a_resume_is_noted() -> None:
    path = "/r/checkpoints/step-00000040.pt"
    aside = ev(
        101, "checkpoint_set_aside", step=40, path=path, moved_to=path + ".bad", reason="truncated: 9 bytes"
    )
    st = status(
        [*START, step(5, 40), aside, resume_ev(102, 30)], RunFacts(run_id="r1", alive=True, now=T0 + 103)
    )
    note = f"checkpoint step 40 failed its check (truncated: 9 bytes): set aside as {path}.bad"
    assert note in st.notes and note in st.to_json()["notes"]
    assert "failed its check" in render_text(st)  # (wrapped to the terminal width)


# --------------------------------------------------------------------------- the live launch's state


def test_a_live_launch_is_starting_until_its_own_first_phase_whatever_the_last_one_ended_with() -> None:
    """The issue's reproduction: launch 1 stopped at step 24; `fab train` resumes. While launch 2's
    processes live, launch 1's `stopped` (and its last live phase, train) are not its state."""
    first = [
        *START,
        ev(1, "phase", phase="train"),
        step(2, 24),
        ev(3, "phase", phase="stopped", during="train"),
    ]
    stopped = status(first, RunFacts(run_id="r1", alive=False, exit_code=0, now=T0 + 4))
    assert (stopped.state, stopped.exit_code) == ("stopped", 10)
    launched = RunFacts(run_id="r1", alive=True, now=T0 + 11, launched_at=T0 + 10, log_mtime=T0 + 10)
    relaunch = ev(
        10.5, "run_start", config="tiny-cpu", run_dir="/r", pid=2, host="h", world_size=1, device="cpu"
    )
    readings = []
    for later in (
        [],
        [relaunch],
        [relaunch, resume_ev(10.6, 24)],
        [relaunch, ev(10.7, "phase", phase="load_data")],
    ):
        st = status([*first, *later], launched)
        readings.append((st.state, st.exit_code, st.step))
    assert readings == [("starting", 0, 24)] * 3 + [("loading", 0, 24)]
    assert status(first, launched).since == T0 + 10
    # Without its launch time (a wrapper from before launched_at) the events decide as before.
    assert status(first, RunFacts(run_id="r1", alive=True, now=T0 + 11)).state == "training"


def test_between_two_attempts_the_run_is_restarted_then_starting() -> None:
    """The restart policy: attempt 1 killed (no final event) and its retry recorded, then the
    back-off, then attempt 2 from its launched_at."""
    events = [*START, ev(1, "phase", phase="train"), step(2, 7)]
    retry = {"attempt": 1, "exit_code": 137, "cause": "exit 137", "retry": True, "ts": T0 + 3}
    backoff = RunFacts(
        run_id="r1", alive=True, now=T0 + 4, launched_at=T0, attempts=(retry,), log_mtime=T0 + 3
    )
    st = status(events, backoff)
    assert (st.state, st.exit_code, st.attempt, st.since) == ("restarted", 0, 2, T0 + 3)
    assert st.to_json()["state"] == "restarted" and "exit 137" in render_text(st)
    second = RunFacts(
        run_id="r1", alive=True, now=T0 + 5, launched_at=T0 + 4.5, attempts=(retry,), log_mtime=T0 + 5
    )
    assert (status(events, second).state, status(events, second).attempt) == ("starting", 2)
    train2 = [*events, ev(6, "phase", phase="train")]
    assert status(train2, replace(second, now=T0 + 7)).state == "training"
    # The last attempt's failure, not retried: the run ends failed once its wrapper is gone.
    final = {**retry, "retry": False, "ts": T0 + 8}
    gone = RunFacts(
        run_id="r1", alive=False, exit_code=1, now=T0 + 9, launched_at=T0 + 4.5, attempts=(final,)
    )
    assert status(train2, gone).state == "failed"


def test_the_fetch_reads_the_launch_time_and_a_wrapper_that_has_only_just_started() -> None:
    def out(*extra: tuple[str, str]) -> str:
        sections = [("now", f"{T0 + 20}"), ("run", "r1"), ("alive", "1"), *extra, ("end", "")]
        return framed(*((name, 0, text) for name, text in sections))

    assert parse_fetch(out(("pid", "77"), ("launched_at", f"{T0 + 9.25}"))).facts.launched_at == T0 + 9.25
    # The lock held, neither its launch time nor its pid written yet: it started just now.
    assert parse_fetch(out()).facts.launched_at == T0 + 20
    assert parse_fetch(out(("pid", "77"))).facts.launched_at is None  # a wrapper from before launched_at
