"""Each known failure signature, recognised on a realistic fixture log (tests/fixtures/logs/)."""

from __future__ import annotations

from pathlib import Path

from fleet.status.diagnose import clean_lines, diagnose, last_traceback

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def _sigs(name: str) -> list[str]:
    return [d.signature for d in diagnose((LOGS / name).read_text())]


def _one(name: str, signature: str):
    found = [d for d in diagnose((LOGS / name).read_text()) if d.signature == signature]
    assert len(found) == 1, f"{signature} not found once in {name}"
    return found[0]


def test_fx_trace_from_threads() -> None:
    d = _one("fx_trace_threads.log", "fx-trace-threads")
    assert "Detected that you are using FX to symbolically trace" in d.evidence
    assert "one process per GPU" in d.fix and "fab warm" in d.fix and "fail_on_recompile" in d.fix
    # the specific signature replaces the generic traceback diagnosis
    assert _sigs("fx_trace_threads.log") == ["fx-trace-threads"]


def test_recompile_limit_then_oom_in_log_order() -> None:
    assert _sigs("recompile_limit.log") == ["recompile-limit", "cuda-oom"]
    d = _one("recompile_limit.log", "recompile-limit")
    assert "(8)" in d.cause and "dense" in d.cause
    assert "fail_on_recompile_limit_hit" in d.fix and "recompile_limit" in d.fix


def test_flex_attention_without_compile() -> None:
    d = _one("flex_dense.log", "flex-uncompiled")
    assert "called without torch.compile()" in d.evidence
    assert "score matrix" in d.cause


def test_cuda_oom_reports_the_size_it_tried() -> None:
    d = _one("cuda_oom.log", "cuda-oom")
    assert "tried to allocate 300.00 GiB" in d.cause
    assert "GPU 0" in d.cause and "94.97 GiB" in d.cause
    assert "dense" in d.cause  # 300 GiB is no tuning problem
    assert _sigs("cuda_oom.log") == ["cuda-oom"]


def test_small_oom_gets_the_tuning_fix() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. "
        "GPU 3 has a total capacity of 79.10 GiB of which 20.00 MiB is free."
    )
    (d,) = diagnose(text)
    assert "512.00 MiB" in d.cause and "GPU 3" in d.cause
    assert "expandable_segments" in d.fix and "dense" not in d.cause


def test_nccl_timeout_and_the_rank_that_died() -> None:
    assert _sigs("nccl_timeout.log") == ["nccl-timeout", "rank-died"]
    t = _one("nccl_timeout.log", "nccl-timeout")
    assert "ALLREDUCE" in t.cause and "600 s" in t.cause
    r = _one("nccl_timeout.log", "rank-died")
    assert "rank 2" in r.cause and "-6" in r.cause and "SIGABRT" in r.cause


def test_rank_killed_by_sigkill() -> None:
    r = _one("rank_died.log", "rank-died")
    assert "rank 6" in r.cause and "-9" in r.cause and "SIGKILL" in r.cause
    assert "OOM killer" in r.fix


def test_nvml_mismatch() -> None:
    d = _one("nvml_mismatch.log", "nvml-mismatch")
    assert d.evidence == "Failed to initialize NVML: Driver/library version mismatch"
    assert "reboot" in d.fix


def test_import_error_points_at_env_check() -> None:
    d = _one("import_error.log", "import-error")
    assert "No module named 'flashinfer'" in d.cause
    assert "fab env-check" in d.fix
    assert _sigs("import_error.log") == ["import-error"]


def test_cannot_import_name_is_env_drift_too() -> None:
    (d,) = diagnose("ImportError: cannot import name 'FlexKernelOptions' from 'torch.nn.attention'\n")
    assert d.signature == "import-error" and "FlexKernelOptions" in d.cause


def test_any_other_traceback_gives_last_frame_and_message() -> None:
    (d,) = diagnose((LOGS / "generic_traceback.log").read_text())
    assert d.signature == "python-traceback"
    assert "KeyError: 'completion_ids'" in d.cause
    assert "/workspace/fleet/current/training/data.py:77 in load_buckets" in d.cause


def test_clean_startup_log_has_no_diagnosis() -> None:
    assert diagnose((LOGS / "startup_fieldnotes.log").read_text()) == []


def test_error_event_is_diagnosed_when_the_log_is_empty() -> None:
    ev = {
        "v": 1,
        "ts": 1.0,
        "event": "error",
        "rank": 0,
        "role": "single",
        "type": "OutOfMemoryError",
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 80 GiB",
        "traceback_tail": "",
    }
    (d,) = diagnose("", [ev])
    assert d.signature == "cuda-oom" and "2.00 GiB" in d.cause


def test_error_event_without_known_signature_is_a_generic_diagnosis() -> None:
    ev = {"event": "error", "type": "ValueError", "message": "bad bucket edges", "traceback_tail": ""}
    (d,) = diagnose("", [ev])
    assert d.signature == "python-traceback" and "ValueError: bad bucket edges" in d.cause


def test_interleaved_ranks_nul_bytes_and_carriage_returns() -> None:
    fx = (LOGS / "fx_trace_threads.log").read_text().splitlines()
    other = "[rank1]: step 10/100 loss 3.2\r[rank1]: step 11/100 loss 3.1"
    mixed = []
    for i, line in enumerate(fx):
        mixed.append(f"[rank0]:{line}")
        if i % 3 == 0:
            mixed.append(other)
    text = "\x00\x00" + "\n".join(mixed)
    assert [d.signature for d in diagnose(text)] == ["fx-trace-threads"]
    assert "\x00" not in "".join(clean_lines(text))


def test_partial_first_line_of_a_tail_is_tolerated() -> None:
    text = (LOGS / "generic_traceback.log").read_text()
    tb = last_traceback(clean_lines(text[10:]))  # cut inside the first line
    assert tb is not None and tb.exception == "KeyError: 'completion_ids'"
    # cut after the traceback header: no traceback can be claimed, and nothing breaks
    assert last_traceback(clean_lines(text[text.index("File") :])) is None


def test_torn_traceback_without_exception_line_is_not_reported() -> None:
    text = 'Traceback (most recent call last):\n  File "/a.py", line 3, in f\n    g()\n'
    assert diagnose(text) == []


def test_generic_tracebacks_of_interleaved_ranks_are_read_per_rank() -> None:
    tb = (LOGS / "generic_traceback.log").read_text().splitlines()
    noise = ["step 10/100 loss 3.2", "Traceback (most recent call last):", '  File "/x.py", line 1, in g']
    mixed = []
    for i, line in enumerate(tb):
        mixed.append(f"[rank1]:{line}")
        mixed.append(f"[rank0]:{noise[i % len(noise)]}")
    (d,) = diagnose("\n".join(mixed))
    assert d.signature == "python-traceback" and "KeyError: 'completion_ids'" in d.cause
    assert "training/data.py:77 in load_buckets" in d.cause


# ---------------------------------------------------------------- full disk, aborts, SIGKILL


def test_full_disk_in_the_data_cache_of_a_real_run() -> None:
    """disk_full.log: the real tiny trainer with its run dir on a 160 KiB tmpfs (HF datasets
    writing its cache through fsspec): named as a full disk, not as a line of fsspec to open."""
    assert _sigs("disk_full.log") == ["disk-full"]
    d = _one("disk_full.log", "disk-full")
    assert "No space left on device" in d.cause and "[Errno 28]" in d.evidence
    assert "df -h" in d.fix and "checkpoint" in d.fix


def test_disk_full_names_the_path_when_the_error_does() -> None:
    log = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n' + (
        "OSError: [Errno 28] No space left on device: '/workspace/fleet/runs/r/checkpoints/.s.tmp'\n"
    )
    (d,) = diagnose(log)
    assert d.signature == "disk-full" and "/workspace/fleet/runs/r/checkpoints/.s.tmp" in d.cause


def test_cpp_abort_from_a_real_uncaught_exception() -> None:
    """cpp_abort.log: a C++ program throwing, run by fleet's remote/run.sh (libstdc++'s report)."""
    (d,) = diagnose((LOGS / "cpp_abort.log").read_text())
    assert d.signature == "cpp-abort" and "std::runtime_error" in d.cause
    assert "illegal memory access" in d.cause and d.evidence.startswith("what():")
    # a NCCL watchdog abort is the timeout's doing: the specific signature, no second diagnosis
    assert "cpp-abort" not in _sigs("nccl_timeout.log")


def test_traceback_of_a_module_qualified_exception() -> None:
    """dynamo_unsupported.log: torch._dynamo.exc.Unsupported (a name not ending in Error)."""
    (d,) = diagnose((LOGS / "dynamo_unsupported.log").read_text())
    assert d.signature == "python-traceback" and d.cause.startswith("torch._dynamo.exc.Unsupported: ")


def test_killed_diagnosis_names_who_killed_the_run() -> None:
    from fleet.status.diagnose import killed_diagnosis

    assert killed_diagnosis(1, "", None, ()) is None
    assert killed_diagnosis(None, "KILL", None, ()) is None
    forced = killed_diagnosis(137, "KILL", None, ())
    assert forced is not None and "fab stop --force" in forced.cause
    oom = "Out of memory: Killed process 4242 (python3) total-vm:9000kB, anon-rss:8000kB, UID:0"
    killed = killed_diagnosis(
        137, "", True, ("oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=4242", oom)
    )
    assert killed is not None and killed.signature == "oom-killer" and killed.evidence == oom
    unknown = killed_diagnosis(137, "TERM", False, ())
    assert unknown is not None and unknown.signature == "sigkill"
    for cause in ("OOM killer", "fab stop --force", "container"):
        assert cause in unknown.cause
    assert "dmesg" in unknown.fix
    readable = killed_diagnosis(137, "", True, ())
    assert readable is not None and "no OOM kill" in readable.fix


def test_a_rendezvous_that_did_not_come_up() -> None:
    """Real logs of `python -m training.launch` under run.sh: a 2-node rendezvous that timed out,
    and an endpoint whose host does not resolve (training.launch's one line each)."""
    (timeout,) = diagnose((LOGS / "rendezvous_timeout.log").read_text())
    assert timeout.signature == "rendezvous" and "did not form within 5 s" in timeout.cause
    assert timeout.fix.startswith("start the same command on every node")
    (unresolved,) = diagnose((LOGS / "rendezvous_unresolved.log").read_text())
    assert unresolved.signature == "rendezvous" and "does not resolve" in unresolved.cause
    assert "/etc/hosts" in unresolved.fix


def test_a_non_finite_loss_is_named_with_its_step_and_never_retried() -> None:
    from fleet.remote.run_cause import first_cause
    from fleet.status.diagnose import FATAL_SIGNATURES, NOT_RETRYABLE

    d = _one("non_finite_loss.log", "non-finite-loss")
    assert d.cause.startswith("non-finite loss at step 2:") and "earlier checkpoints are kept" in d.cause
    assert "train.lr" in d.fix and "replays the same step" in d.fix
    assert _sigs("non_finite_loss.log") == ["non-finite-loss"] and "non-finite-loss" in FATAL_SIGNATURES
    rows = "\n".join(f"{sig}\t{pattern}" for sig, pattern in NOT_RETRYABLE)
    assert first_cause((LOGS / "non_finite_loss.log").read_text(), rows) == "non-finite-loss"
