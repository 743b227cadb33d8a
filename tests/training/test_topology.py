"""N+M topology: parsing, the wire format, the split advisor, and real torchrun jobs on gloo.

The torchrun tests start ``python -m torch.distributed.run`` as a subprocess on the tiny
CPU config (1 thread per rank) and compare against the single-process trainer with
``pipeline.order=fixed`` (drafters take the global batches in the single trainer's order).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.config import ConfigError, load_config
from training.events import read_events, validate_event
from training.run.pipeline import KIND_BATCH, Header, Message, RankLost, WorkItem, ready_messages, unpack
from training.run.plan import best_split, predict_splits
from training.topology import Topology, parse_topology, pin_visible_gpu, visible_gpu_of

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "--train.log_every=1",
    "--train.torch_threads=1",
    "--eval.num_prompts=0",
    "--checkpoint.every=0",
    "--pipeline.timeout_s=60",
]
PLAN = [sys.executable, "-m", "training", "plan", "--config", "tiny-cpu"]
TRAIN = [sys.executable, "-m", "training", "train", "--config", "tiny-cpu"]
HANG_GUARD_S = 600  # a subprocess still running after this is a hang (not a speed check)


# ---------------------------------------------------------------- pure parts
def test_parse_topology_and_roles() -> None:
    topo = parse_topology(" 5 + 3 ")
    assert topo == Topology(5, 3) and str(topo) == "5+3" and topo.world_size == 8
    assert [topo.role_of(r) for r in (0, 4, 5, 7)] == [
        ("target", 0),
        ("target", 4),
        ("drafter", 0),
        ("drafter", 2),
    ]
    assert topo.target_ranks == [0, 1, 2, 3, 4] and topo.drafter_ranks == [5, 6, 7]
    with pytest.raises(ValueError):
        topo.role_of(8)


def test_each_rank_gets_its_own_gpu_as_the_only_visible_one() -> None:
    assert [visible_gpu_of(r, None) for r in (0, 5)] == ["0", "5"]
    assert [visible_gpu_of(r, "4,5, 6,7") for r in range(4)] == ["4", "5", "6", "7"]
    assert visible_gpu_of(1, "GPU-aaaa,GPU-bbbb") == "GPU-bbbb"
    with pytest.raises(ConfigError, match="LOCAL_RANK 2 but CUDA_VISIBLE_DEVICES='0,1' lists 2 GPUs"):
        visible_gpu_of(2, "0,1")


def test_a_cpu_run_leaves_the_visible_gpus_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    config = load_config("tiny-cpu", ["--model.device=cpu"])
    assert pin_visible_gpu(config, 1) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3,4"


@pytest.mark.parametrize("text", ["", "5", "5+", "+3", "0+2", "2+0", "5x3", "a+b", "5+3+1"])
def test_parse_topology_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="topology"):
        parse_topology(text)


def test_a_lost_peer_is_named_even_with_other_peers_messages_queued_behind_it() -> None:
    """A drafter's inbox: target 1's receiver reported its error, target 0's header arrived after
    it (a 2+1 job whose rank 1 was killed). The error names rank 1, whatever follows it."""
    import queue

    inbox: queue.Queue[Message] = queue.Queue()
    header = Header(KIND_BATCH, 3, 0, 3, 0, 1, 4, 1, 8, torch.float32)
    inbox.put(Message(0, "header", header))
    inbox.put(Message(1, "error", RuntimeError("Connection closed by peer [127.0.0.1]:62632\nmore")))
    inbox.put(Message(0, "header", header))
    got = []
    with pytest.raises(RankLost) as lost:
        got.extend(ready_messages(inbox, lambda rank: f"rank {rank} (target {rank})"))
    assert [m.peer for m in got] == [0] and lost.value.peer == 1
    assert str(lost.value) == "lost rank 1 (target 1): Connection closed by peer [127.0.0.1]:62632"
    assert list(ready_messages(inbox, str)) == [Message(0, "header", header)]  # the rest stays


def test_pipeline_section_in_config() -> None:
    config = load_config("tiny-cpu", ["--pipeline.topology=2+1", "--pipeline.order=fixed"])
    assert config.pipeline.topology == "2+1" and config.pipeline.order == "fixed"
    with pytest.raises(ConfigError, match=r"pipeline\.order"):
        load_config("tiny-cpu", ["--pipeline.order=random"])


def test_work_item_round_trip() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    item = WorkItem(
        seq=42,
        epoch=1,
        index=7,
        bucket=2,
        input_ids=ids,
        loss_mask=mask,
        lengths=torch.tensor([3, 4]),
        anchors=torch.tensor([[0, -1], [1, 2]]),
        hidden=torch.randn(2, 4, 6, dtype=torch.bfloat16),
    )
    header = Header.from_tensor(item.header().to_tensor())
    assert header.kind == KIND_BATCH and (header.seq, header.epoch, header.index, header.bucket) == (
        42,
        1,
        7,
        2,
    )
    assert (header.batch, header.length, header.anchors, header.features) == (2, 4, 2, 6)
    assert header.dtype == torch.bfloat16 and header.meta_numel == item.meta().numel()
    back = unpack(header, item.meta(), item.hidden)
    for name in ("input_ids", "loss_mask", "lengths", "anchors"):
        assert torch.equal(getattr(back, name), getattr(item, name)), name


def test_plan_split_arithmetic() -> None:
    # The user's figures: 6+2 ran drafter-bound at 13.5K tok/s (6.75K per drafter rank).
    splits = predict_splits(8, target_rate=4200.0, drafter_rate=6750.0)
    by_name = {str(s): s for s in splits}
    assert list(by_name) == ["1+7", "2+6", "3+5", "4+4", "5+3", "6+2", "7+1"]
    assert by_name["6+2"].tokens_per_s == pytest.approx(13500.0) and by_name["6+2"].bottleneck == "drafter"
    assert by_name["5+3"].tokens_per_s == pytest.approx(20250.0)
    assert by_name["4+4"].tokens_per_s == pytest.approx(16800.0) and by_name["4+4"].bottleneck == "target"
    assert by_name["5+3"].target_busy == pytest.approx(20250.0 / 21000.0)
    assert str(best_split(splits)) == "5+3"
    # DDP scaling loss moves the optimum towards more drafters.
    slow = predict_splits(8, target_rate=4200.0, drafter_rate=6750.0, ddp_efficiency=0.8)
    assert by_name["5+3"].tokens_per_s > {str(s): s for s in slow}["5+3"].tokens_per_s
    # Ties go to fewer target ranks; a perfect balance is reported as such.
    even = predict_splits(4, 100.0, 100.0)
    assert str(best_split(even)) == "2+2" and best_split(even).bottleneck == "balanced"


@pytest.mark.parametrize("args", [(1, 1.0, 1.0), (4, 0.0, 1.0), (4, 1.0, -2.0)])
def test_plan_rejects_bad_input(args: tuple[int, float, float]) -> None:
    with pytest.raises(ConfigError, match="plan"):
        predict_splits(*args)


def test_plan_cli_with_given_rates() -> None:
    out = subprocess.run(
        [*PLAN, "--gpus", "8", "--json", "--target-rate", "4200", "--drafter-rate", "6750"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["best"]["targets"] == 5 and data["best"]["drafters"] == 3 and len(data["splits"]) == 7


@pytest.mark.parametrize(
    ("topology", "expected"),
    [("5x3", "expected N+M"), ("1+1", "needs torchrun"), ("", "pipeline.credits")],
)
def test_bad_topology_input_is_one_line(topology: str, expected: str, tmp_path: Path) -> None:
    argv = [*TRAIN, "--run-dir", str(tmp_path / "run"), "--topology", topology]
    if not topology:  # the config's topology, with a bad knob
        argv += ["--pipeline.topology=1+1", "--pipeline.credits=0"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


@pytest.mark.slow
def test_plan_probe_on_cpu(tiny_cache: Path) -> None:
    """The real probe (tiny model, CPU): positive rates and a prediction for every split."""
    proc = subprocess.run(
        [*PLAN, "--gpus", "4", "--batches", "1", "--warmup", "0", "--json", "--train.torch_threads=1"],
        cwd=REPO,
        env=_env(tiny_cache),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    rates = data["rates"]
    assert rates["device"] == "cpu" and rates["batches"] == 1 and rates["tokens"] > 0
    assert rates["target_tokens_per_s"] > 0 and rates["drafter_tokens_per_s"] > 0
    assert [(s["targets"], s["drafters"]) for s in data["splits"]] == [(1, 3), (2, 2), (3, 1)]


# ---------------------------------------------------------------- real torchrun jobs (slow)
def _env(cache: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    # FLEET_DATA_CACHE: the runs of this module train the same data; tokenized once, not per rank and run
    env.update(
        FLEET_TRAINING_CACHE=str(cache),
        FLEET_DATA_CACHE=str(cache / "data"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    return env


def _torchrun(topology: str, run_dir: Path, extra: list[str], config: str = "tiny-cpu") -> list[str]:
    nproc = sum(int(x) for x in topology.split("+"))
    return [
        sys.executable,
        "-m",
        "training.launch",  # torchrun (same arguments); SIGTERM = clean stop; loopback rendezvous
        f"--nproc-per-node={nproc}",
        "-m",
        "training",
        "train",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        "--topology",
        topology,
        *COMMON,
        *extra,
    ]


def _wait_for_step(run_dir: Path, proc: subprocess.Popen[str], step: int) -> list[dict[str, object]]:
    """The events once a drafter logged ``step`` (polls the file; fails if the job ends first)."""
    path = run_dir / "events.jsonl"
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1.0)
        events = read_events(path) if path.is_file() else []
        if any(e["event"] == "step" and e["step"] >= step for e in events):
            return events
    raise AssertionError(f"the job never reached step {step} (exit {proc.poll()})")


def _losses(run_dir: Path, role: str) -> list[float]:
    events = read_events(run_dir / "events.jsonl")
    return [e["loss"] for e in events if e["event"] == "step" and e["role"] == role]


@pytest.fixture(scope="module")
def single_losses(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("single")
    subprocess.run(
        [*TRAIN, "--run-dir", str(run_dir), *COMMON, "--train.steps=4"],
        cwd=REPO,
        env=_env(tiny_cache),
        capture_output=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    losses = _losses(run_dir, "single")
    assert len(losses) == 4
    return losses


@pytest.mark.slow
def test_topology_matches_single_process(
    single_losses: list[float], tiny_cache: Path, tmp_path: Path
) -> None:
    """2+1, fixed order: the drafter's losses are the single process's, batch by batch, with both
    targets producing. (1+1's equality: the hybrid target's test below; 1+1 ends and stops in the
    killed, hung and SIGTERM tests, and in tests/training/test_rendezvous.py.)"""
    topology = "2+1"
    run_dir = tmp_path / "run"
    argv = _torchrun(topology, run_dir, ["--train.steps=4", "--pipeline.order=fixed", "--pipeline.credits=1"])
    proc = subprocess.run(
        argv, cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(run_dir, "drafter") == pytest.approx(single_losses, rel=1e-4, abs=1e-5)
    events = read_events(run_dir / "events.jsonl")
    assert all(not validate_event(e) for e in events), [
        validate_event(e) for e in events if validate_event(e)
    ]
    ranks = {e["rank"]: e["role"] for e in events if e["event"] == "run_start"}
    n = int(topology.split("+")[0])
    assert ranks == {r: ("target" if r < n else "drafter") for r in range(n + 1)}
    balance_roles = {e["role"] for e in events if e["event"] == "balance"}
    assert balance_roles == {"target", "drafter"}
    final = {e["rank"]: e["phase"] for e in events if e["event"] == "phase"}
    assert set(final.values()) == {"done"}
    # Both targets produced: global batches 0..3 came from targets (g % 2).
    batches = [e["batch"] for e in events if e["event"] == "step"]
    assert batches == [0, 1, 2, 3]
    assert (run_dir / "checkpoints" / "step-00000004.pt").is_file()


@pytest.mark.slow
def test_free_order_two_drafters_trains(tiny_cache: Path, tmp_path: Path) -> None:
    """1+2, free order: DDP over two drafters, every step on both, distinct batches."""
    run_dir = tmp_path / "run"
    argv = _torchrun("1+2", run_dir, ["--train.steps=3"])
    proc = subprocess.run(
        argv, cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(run_dir / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert sorted((e["rank"], e["step"]) for e in steps) == [(r, s) for r in (1, 2) for s in (1, 2, 3)]
    assert len({e["batch"] for e in steps}) == 6  # no batch trained twice
    done = [e for e in events if e["event"] == "done"]
    assert {e["rank"] for e in done} == {1, 2}


@pytest.mark.slow
def test_a_placement_keeps_each_targets_batches_on_its_hosts_drafter(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """2+2 placed as two hosts of 1+1 (ranks 0 t0, 1 d0 | 2 t1, 3 d1): each target sends only to
    the drafter of its host, so drafter 0 trains on target 0's batches (even: g % 2 == 0), drafter
    1 on target 1's (odd); drafter 0 (rank 1) checkpoints."""
    run_dir = tmp_path / "run"
    argv = [*_torchrun("2+2", run_dir, ["--train.steps=3"]), "--placement", "1+1,1+1"]
    proc = subprocess.run(
        argv, cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(run_dir / "events.jsonl")
    roles = {e["rank"]: (e["role"]) for e in events if e["event"] == "run_start"}
    assert roles == {0: "target", 1: "drafter", 2: "target", 3: "drafter"}
    batches = {r: [e["batch"] for e in events if e["event"] == "step" and e["rank"] == r] for r in (1, 3)}
    assert len(batches[1]) == len(batches[3]) == 3, batches
    assert all(b % 2 == 0 for b in batches[1]) and all(b % 2 == 1 for b in batches[3]), batches
    assert (run_dir / "checkpoints" / "step-00000003.pt").is_file()
    assert {e["rank"] for e in events if e["event"] == "done"} == {1, 3}


@pytest.mark.slow
def test_killed_rank_ends_job_with_error_naming_it(tiny_cache: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = _torchrun("2+1", run_dir, ["--train.steps=100000"])
    proc = subprocess.Popen(
        argv, cwd=REPO, env=_env(tiny_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        events = _wait_for_step(run_dir, proc, 2)
        victim = next(e["pid"] for e in events if e["event"] == "run_start" and e["rank"] == 1)
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, output[-2000:]
    errors = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "error"]
    host = socket.gethostname()
    named = [e for e in errors if f"lost rank 1 (target 1 on host {host}, pid {victim}" in e["message"]]
    assert named, [e["message"] for e in errors]
    assert named[0]["role"] == "drafter" and not validate_event(named[0])
    assert (named[0]["peer_rank"], named[0]["peer_role"], named[0]["peer_host"]) == (1, "target", host)


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_cleanly(tiny_cache: Path, tmp_path: Path) -> None:
    """`fab stop` signals the run's process group: checkpoint, `stopped` on every rank, exit 0."""
    run_dir = tmp_path / "run"
    argv = _torchrun("1+1", run_dir, ["--train.steps=100000"])
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=_env(tiny_cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_step(run_dir, proc, 2)
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    events = read_events(run_dir / "events.jsonl")
    last_phase = {e["rank"]: e["phase"] for e in events if e["event"] == "phase"}
    assert last_phase == {0: "stopped", 1: "stopped"}
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved and (run_dir / "checkpoints" / f"step-{saved[-1]:08d}.pt").is_file()
    assert not [e for e in events if e["event"] == "error"]


@pytest.mark.slow
def test_hung_rank_ends_job_after_the_timeout(tiny_cache: Path, tmp_path: Path) -> None:
    """A rank that stops answering (SIGSTOP: alive, silent) ends the job once the timeout passes."""
    run_dir = tmp_path / "run"
    # 10 s: the join and the startup barriers have their own long timeout (training/topology.py),
    # so a short one only has to outlast a step of a loaded 2-core machine.
    argv = _torchrun("1+1", run_dir, ["--train.steps=100000", "--pipeline.timeout_s=10"])
    proc = subprocess.Popen(
        argv, cwd=REPO, env=_env(tiny_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    victim = None
    try:
        events = _wait_for_step(run_dir, proc, 2)
        victim = next(e["pid"] for e in events if e["event"] == "run_start" and e["rank"] == 0)
        os.kill(victim, signal.SIGSTOP)
        # The drafter names the silent rank once the timeout passes; then the frozen rank is killed:
        # torchrun's teardown would wait 30 s more for it to take a SIGTERM it cannot take while stopped.
        deadline = time.monotonic() + HANG_GUARD_S
        while not _lost_rank_0(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, output[-2000:]
    errors = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "error"]
    assert _lost_rank_0(run_dir), errors


def _lost_rank_0(run_dir: Path) -> bool:
    """Whether the drafter (rank 1) reported target rank 0 lost."""
    errors = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "error"]
    return any("rank 0 (target 0 on host" in e["message"] and e["rank"] == 1 for e in errors)


@pytest.mark.slow
def test_hybrid_target_in_a_topology_matches_single_process(tiny_cache: Path, tmp_path: Path) -> None:
    """The Qwen3.5/3.6 architecture (tiny, multimodal layout) as the target of a 1+1 job: the
    same losses as one process, and the target rank (only it) reports its linear-attention kernels."""
    hybrid = ["--model.checkpoint_layout=multimodal", "--train.steps=3"]
    single = tmp_path / "single"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--config",
            "tiny-qwen3.5-cpu",
            "--run-dir",
            str(single),
            *COMMON,
            *hybrid,
        ],
        cwd=REPO,
        env=_env(tiny_cache),
        capture_output=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    run_dir = tmp_path / "run"
    argv = _torchrun("1+1", run_dir, [*hybrid, "--pipeline.order=fixed"], config="tiny-qwen3.5-cpu")
    proc = subprocess.run(
        argv, cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(run_dir, "drafter") == pytest.approx(_losses(single, "single"), rel=1e-4, abs=1e-5)
    assert "target 0: target kernels: 6 linear-attention layers, fast path no" in proc.stdout
    events = read_events(run_dir / "events.jsonl")
    targets = [e for e in events if e["event"] == "target"]
    assert [(e["rank"], e["role"], e["linear_layers"]) for e in targets] == [(0, "target", 6)]
    assert all(not validate_event(e) for e in events)


def test_fill_ratio_is_real_over_padded_tokens_of_the_batches() -> None:
    from training.run.plan import fill_ratio

    # rows padded to their bucket's width: 6 real of 8, then 8 of 8, then 1 of 4
    assert fill_ratio([(4, [4, 2]), (8, [8]), (4, [1])]) == (6 + 8 + 1) / (8 + 8 + 4)
    assert fill_ratio([]) == 1.0
