"""Progress at a steady cadence, stop signals in any phase, and config.json's loaded target shape."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from training.config import load_config, resume_mismatches, with_loaded_shape, write_config
from training.events import EventWriter, read_events, validate_event
from training.progress import Progress, StopRequested, StopSignals, report_to


def test_progress_reports_by_time_while_a_unit_takes_long(tmp_path: Path) -> None:
    """No unit completes for a while: the reporter still writes events (done unchanged), then the
    final one with done = total; every event follows the contract."""
    beats = threading.Event()
    seen: list[dict[str, Any]] = []

    def emit(**fields: Any) -> None:
        seen.append(fields)
        if len(seen) >= 4:
            beats.set()

    with Progress("load_data", "regenerating", 10, "tokens", emit=emit, every_s=0.01) as p:
        assert beats.wait(60), "the reporter thread wrote no events"
        p.update(3)
    assert [s["done"] for s in seen[:4]] == [0.0] * 4
    assert seen[-1]["done"] == 10 and seen[-1]["total"] == 10 and seen[-1]["unit"] == "tokens"
    writer = EventWriter(tmp_path)
    report_to(writer)
    try:
        with Progress("eval", "evaluating", 4, "tokens") as p:
            p.update(2)
    finally:
        report_to(None)
        writer.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["progress", "progress"]
    assert all(validate_event(e) == [] for e in events)


def test_a_phase_wide_progress_reports_first_and_is_quiet_while_a_stage_inside_reports() -> None:
    """The outer Progress reports on entry; while an inner one is open only the inner beats;
    after it the outer beats again."""
    seen: list[tuple[str, float]] = []
    inner_beats, outer_back = threading.Event(), threading.Event()

    def emit(**fields: Any) -> None:
        seen.append((fields["what"], fields["done"]))
        if fields["what"] == "stage" and len(seen) >= 6:
            inner_beats.set()
        if fields["what"] == "phase" and fields["done"] == 1 and len(seen) > 8:
            outer_back.set()

    with Progress("load_data", "phase", 2, "stages", emit=emit, every_s=0.01) as outer:
        assert seen[0] == ("phase", 0.0)
        with Progress("load_data", "stage", 5, "tokens", emit=emit, every_s=0.01):
            assert inner_beats.wait(60), "the inner Progress wrote no beats"
            during = len(seen)
        outer.advance()
        assert outer_back.wait(60), "the outer Progress did not beat again after the stage"
    first_inner = seen.index(("stage", 0.0))
    outer_during = [item for item in seen[first_inner:during] if item[0] == "phase"]
    assert len(outer_during) <= 1, outer_during  # one outer beat may be in flight as the inner enters
    assert seen[-1] == ("phase", 2.0)


def test_progress_echoes_only_when_it_moved() -> None:
    lines: list[str] = []
    p = Progress("load_data", "regenerating", 100, "tokens", echo=lines.append, echo_every_s=0.0)
    p.report()
    p.report()  # nothing moved since: no second line
    p.update(50)
    p.report()
    assert len(lines) == 2 and "regenerating 50/100 tokens (50%)" in lines[1]


def test_a_stop_signal_raises_inside_anywhere_and_only_flags_outside() -> None:
    announced: list[int] = []
    signals = StopSignals(announced.append)
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside: a flag for the step loop
        assert signals.requested == signal.SIGTERM and announced == [signal.SIGTERM]
        with pytest.raises(StopRequested):  # one that came before: raised on entry
            with signals.anywhere():
                pass
        signals.requested = None
        with pytest.raises(StopRequested):
            with signals.anywhere():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10_000_000):  # the handler runs between bytecodes
                    pass
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) != signals._handle  # restored


def test_config_json_records_the_loaded_targets_shape_and_a_resume_still_matches(tmp_path: Path) -> None:
    """The smol run's config.json: SmolLM2's shape, not the tiny model's defaults; and the next
    launch (whose [model] still holds the defaults) is not refused for it."""
    config = load_config("smol-cpu", [])
    smol = SimpleNamespace(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=None, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
    )  # fmt: skip
    written = write_config(with_loaded_shape(config, smol), tmp_path)
    saved = json.loads(written.read_text())
    model = saved["model"]
    assert (model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]) == (576, 30, 49152)
    assert model["head_dim"] == 64  # derived as Llama does: hidden / heads
    assert resume_mismatches(saved, config) == []
    tiny = load_config("tiny-cpu", [])
    assert with_loaded_shape(tiny, smol) == tiny  # a built target's shape is its config's
