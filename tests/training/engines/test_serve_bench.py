"""The serving benchmark's pure parts: llama-server's /metrics parsed, the table summarized."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.config import ConfigError
from training.engines.llamacpp import LlamaBuild
from training.engines.serve_bench import (
    bench_lengths,
    default_draft_lengths,
    parse_engine_args,
    parse_lengths,
    summarize,
)
from training.engines.server import SPEC_COUNTERS, Completion, EngineRun, parse_metrics, server_argv

# The shape of llama-server's /metrics (tools/server/server-task.cpp: HELP, TYPE, then the value).
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 1400
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 210
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 200
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 1.23457e+06
"""


def test_metrics_are_parsed_by_name() -> None:
    values = parse_metrics(METRICS)
    assert [values[name] for name in SPEC_COUNTERS.values()] == [1400, 210, 200]
    assert values["llamacpp:predicted_tokens_seconds"] == pytest.approx(1.23457e6)
    assert "# HELP" not in "".join(values)


def _run(
    draft: int, texts: list[str], ms: float, drafted: int = 0, accepted: int = 0, rounds: int = 0
) -> EngineRun:
    done = tuple(Completion(tuple(ord(c) for c in t), t, len(t), ms) for t in texts)
    return EngineRun(draft, done, drafted, accepted, rounds)


def test_summary_speedup_acceptance_and_identity() -> None:
    alone = _run(0, ["abcd", "efgh"], 100.0)  # 8 tokens in 200 ms: 40 tok/s
    fast = _run(7, ["abcd", "efgh"], 50.0, drafted=70, accepted=12, rounds=10)
    wrong = _run(3, ["abcd", "efgX"], 25.0, drafted=30, accepted=3, rounds=10)
    out = summarize(
        [alone, fast, wrong],
        step=5,
        max_new_tokens=4,
        block_size=8,
        backend="cpu",
        threads=2,
        project_tau=2.1,
        drafter_gguf=Path("d.gguf"),
        target_gguf=Path("t.gguf"),
        seconds=1.0,
    )
    assert [r.tok_s for r in out.rows] == [40.0, 80.0, 160.0]
    assert [r.speedup for r in out.rows] == [1.0, 2.0, 4.0]
    assert [r.identical for r in out.rows] == [2, 2, 1]
    assert [r.first_diff for r in out.rows] == [-1, -1, 3]  # "efgX" parts from "efgh" at index 3
    assert "part at token 3" in out.text()
    assert out.rows[1].mean_len == pytest.approx(2.2) and out.rows[1].accept_rate == pytest.approx(
        12 / 70, abs=1e-4
    )
    assert out.engine_tau == pytest.approx(2.2) and out.agreement == pytest.approx(0.1)
    assert (out.best_draft, out.best_speedup, out.all_identical) == (3, 4.0, False)
    assert "DIFFER" in out.text() and out.event_fields()["draft_lengths"] == [0, 7, 3]


def test_draft_lengths() -> None:
    assert default_draft_lengths(16) == [1, 3, 7, 15]
    assert default_draft_lengths(8) == [1, 3, 7]
    assert parse_lengths("7,3, 3") == [3, 7] and parse_lengths("") is None
    assert bench_lengths([3], 8) == [3, 7]  # block - 1 always: the agreement is read there
    assert bench_lengths(None, 16) == [1, 3, 7, 15]
    with pytest.raises(ConfigError, match=r"each must be 1\.\.7"):
        bench_lengths([8], 8)


def test_engine_args_reach_every_server_and_may_not_take_serve_bench_own_flags(tmp_path: Path) -> None:
    extra = parse_engine_args("-bs  --spec-draft-p-min '0.5'")
    assert extra == ("-bs", "--spec-draft-p-min", "0.5") and parse_engine_args("") == ()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").touch()
    build = LlamaBuild(tmp_path, tmp_path / "bin", "11434.0.0", "0" * 64, cuda=True, key="k")
    for drafter, draft in ((None, 0), (tmp_path / "d.gguf", 7)):
        argv = server_argv(
            build,
            tmp_path / "t.gguf",
            drafter,
            draft,
            port=1,
            ctx=512,
            threads=2,
            gpu_layers=999,
            extra=extra,
        )
        assert argv[-3:] == list(extra) and ("--spec-type" in argv) == bool(draft)
    with pytest.raises(ConfigError, match=r"--port, -md is set by serve-bench"):
        parse_engine_args("-md x.gguf --port 9")
    with pytest.raises(ConfigError, match="--engine-args"):
        parse_engine_args("-bs 'unclosed")


def test_serve_bench_of_a_dir_without_a_run_is_one_line_and_writes_no_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.__main__ import main

    assert main(["serve-bench", "--run-dir", str(tmp_path), "--draft-lengths", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert not (tmp_path / "events.jsonl").exists()
    assert main(["serve-bench", "--run-dir", str(tmp_path), "--draft-lengths", "x"]) == 2
    assert "--draft-lengths 'x'" in capsys.readouterr().err
