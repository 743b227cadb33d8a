"""Compile-cache warming: key, manifest, counters, `fab warm` -> `fab train` hits, blob reuse.

The slow tests run the real thing on the CPU inductor (gcc): `fab deploy` + `fab warm` on a local
target, then `fab train` and a trainer on an empty cache dir that only got the Mega-Cache blob.
The config is shrunk to one bucket, one batch shape and one mask variant (one compiled
attention graph): a CPU inductor compile of it takes a minute or two on a busy 2-core box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import testkit
import torch
from testkit import TINY_COMPILE_OVERRIDES

from training.__main__ import main as training_main
from training.compile import cache as cc
from training.config import load_config
from training.data.buckets import EpochPlanner
from training.events import read_events
from training.run.warm import compile_shapes, config_hash, run_warm

REPO = Path(__file__).resolve().parents[3]
FAB = Path(sys.executable).parent / "fab"
TINY = [
    *TINY_COMPILE_OVERRIDES,
    "--train.steps=2",
    "--eval.num_prompts=0",
    # every run here pre-warms and then forbids recompiles: a run from the warm cache or the
    # shipped blob alone must not compile anything, and would fail here if it did
    "--compile.fail_on_recompile=true",
]


# ------------------------------------------------------------------ key, manifest, counters
def test_key_text_joins_the_parts_in_order_and_makes_them_path_safe() -> None:
    key = cc.CacheKey(
        lock="abc123", torch="2.13.0+cu130", triton="3.6.0", device="NVIDIA H200/x", cuda="13.0"
    )
    assert key.text == "abc123-torch2.13.0+cu130-triton3.6.0-NVIDIA-H200-x-cuda13.0"
    assert "/" not in cc.CacheKey("a/b", "1", "none", "../..", "none").text


def test_env_lock_hash_comes_from_the_fleet_env_manifest(tmp_path: Path) -> None:
    venv = tmp_path / "train-0123" / "venv"
    venv.mkdir(parents=True)
    assert cc.env_lock_hash(venv) == "nolock"
    manifest = tmp_path / "train-0123" / "fleet-env" / "manifest.json"  # beside the venv
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"lock_sha256": "f" * 64, "env_hash": "0123"}))
    assert cc.env_lock_hash(venv) == "f" * 12
    manifest.write_text("{not json")
    assert cc.env_lock_hash(venv) == "nolock"
    inside = venv / "fleet-env" / "manifest.json"  # or inside it
    inside.parent.mkdir()
    inside.write_text(json.dumps({"env_hash": "beef"}))
    assert cc.env_lock_hash(venv) == "beef"


def test_cpu_key_names_versions_and_arch_but_no_device_index(tmp_path: Path) -> None:
    key = cc.cache_key(torch.device("cpu"), prefix=tmp_path)
    assert key.lock == "nolock"
    assert key.torch == torch.__version__
    assert key.device.startswith("cpu-") and key.device != "cpu-"
    assert key.cuda == (torch.version.cuda or "none")
    assert key.triton == cc.triton_version()
    assert cc.cache_key(torch.device("cpu", 0), prefix=tmp_path) == key


def _manifest(key: str = "k", digest: str = "h", complete: bool = True) -> cc.Manifest:
    return cc.Manifest(
        key=key,
        config="tiny-cpu",
        config_hash=digest,
        buckets=(0, 65),
        shapes=(cc.ShapeRecord(0, 11, 64, 1.5),),
        variants=1,
        recompile_limit=8,
        seconds=2.0,
        torch="2.13.0",
        triton="none",
        device="cpu-x86_64",
        blob_bytes=3,
        created_at="2026-11-30T00:00:00+00:00",
        complete=complete,
        counters={"fxgraph_miss": 2},
    )


def _children_environ(pid: int) -> list[dict[str, str]]:
    """The environments of ``pid``'s descendants (from /proc)."""
    out = []
    for task in Path("/proc").glob("[0-9]*"):
        try:
            stat = (task / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            raw = (task / "environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        out.append(env)
        out.extend(_children_environ(int(task.name)))
    return out


@pytest.mark.slow
def test_compile_workers_start_early_with_the_keys_cache_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's compile workers (real ones, started by torch's own warm-up) are up before any
    compile, and they were started with the key's Triton / inductor dirs in their environment:
    kernels they compile land in the cache the warm-up ships. Only the GPU's name is stood in."""
    from torch._inductor import async_compile

    if torch._inductor.config.compile_threads <= 1:
        pytest.skip("inductor runs no compile workers with compile_threads <= 1 (one CPU)")
    monkeypatch.setenv(cc.ROOT_ENV, str(tmp_path))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cc, "device_label", lambda device: "NVIDIA-H200-sm90")
    assert cc.start_workers(torch.device("cpu")) is False  # the CPU inductor has no Triton pool
    try:
        assert cc.start_workers(torch.device("cuda")) is True
        key_dir = cc.CacheDir(tmp_path, cc.cache_key(torch.device("cuda"))).path
        deadline = time.monotonic() + 120
        envs: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            envs = [e for e in _children_environ(os.getpid()) if "TRITON_CACHE_DIR" in e]
            if envs:
                break
            time.sleep(0.5)
        assert envs, "no compile worker started"
        for env in envs:
            assert env["TRITON_CACHE_DIR"].startswith(str(key_dir)), env["TRITON_CACHE_DIR"]
            assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(key_dir))
    finally:
        async_compile.shutdown_compile_workers()


def test_manifest_round_trips_and_only_a_complete_one_with_its_blob_counts(tmp_path: Path) -> None:
    cache = cc.CacheDir(tmp_path, cc.CacheKey("nolock", "2.13.0", "none", "cpu-x86_64", "none"))
    assert cache.manifest() is None and cache.complete_manifest() is None
    cache.write_manifest(_manifest(cache.key.text, "h1", complete=False))
    assert cache.manifest() == _manifest(cache.key.text, "h1", complete=False)
    assert cache.complete_manifest() is None  # not complete
    cache.write_manifest(_manifest(cache.key.text, "h1"))
    assert cache.complete_manifest() is None  # no blob
    cache.blob_path.write_bytes(b"abc")
    assert cache.complete_manifest("h1") == _manifest(cache.key.text, "h1")
    assert cache.complete_manifest("other config") is None
    cache.manifest_path.write_text('{"key": "k"}')
    assert cache.manifest() is None
    with pytest.raises(ValueError):
        cc.Manifest.from_json("[1, 2]")


def test_manifest_records_the_target_kernels_warm_up_and_reads_older_manifests() -> None:
    hybrid = replace(_manifest(), target_fast_path="yes", target_shapes=(cc.ShapeRecord(0, 4, 4096, 47.0),))
    assert cc.Manifest.from_json(hybrid.to_json()) == hybrid
    older = json.loads(_manifest().to_json())
    del older["target_fast_path"], older["target_shapes"]  # written before the target was warmed
    read = cc.Manifest.from_json(json.dumps(older))
    assert read.target_fast_path == "" and read.target_shapes == ()


class _Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        self.events.append((event, fields))
        return fields


def test_counter_reporter_emits_at_first_call_and_then_only_on_change() -> None:
    from torch._dynamo.utils import counters

    sink, reporter = _Sink(), cc.CounterReporter("the-key")
    before = cc.cache_counters()
    assert reporter.report(sink) == before
    assert reporter.report(sink) is None
    counters["inductor"]["fxgraph_cache_miss"] += 1
    try:
        after = reporter.report(sink)
    finally:
        counters["inductor"]["fxgraph_cache_miss"] -= 1
    assert after is not None and after["fxgraph_miss"] == before["fxgraph_miss"] + 1
    assert [name for name, _ in sink.events] == ["compile_cache", "compile_cache"]
    fields = sink.events[0][1]
    assert set(fields) == {"fxgraph_hit", "fxgraph_miss", "aotautograd_hit", "aotautograd_miss", "key"}
    assert fields["key"] == "the-key"


def test_compile_shapes_are_one_per_bucket_tail_batches_included() -> None:
    lengths = np.array([10] * 7 + [50] * 7 + [120] * 5)
    planner = EpochPlanner(
        lengths, num_buckets=2, max_length=128, token_budget=512, max_batch_size=64, seed=0
    )
    shapes = compile_shapes(planner)
    got = {(s.bucket, s.batch_size, s.length) for s in shapes}
    expected = {
        (b, len(idx), planner.padded_length(b)) for epoch in range(3) for b, idx in planner.plan(epoch)
    }
    assert got == expected
    # Tail batches are topped up to the bucket's batch size: no extra shape per bucket.
    assert len(shapes) == len(planner.boundaries) - 1


# ------------------------------------------------------------------ warm CLI: cheap paths
def test_warm_with_an_unusable_cache_dir_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = training_main(["warm", "--config", "tiny-cpu", "--cache-dir", str(blocker / "cache"), *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: warm --cache-dir") and "Traceback" not in err[0]


def test_warm_if_needed_skips_a_complete_cache_and_off_compiles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # activate() sets them: restore after
        monkeypatch.setenv(name, os.environ.get(name, str(tmp_path / name)))
    lines: list[str] = []
    off = load_config("tiny-cpu", [*TINY, "--compile.enabled=auto"])  # auto: GPU only
    assert run_warm(off, tmp_path, echo=lines.append) is None
    assert "nothing to warm" in lines[-1]
    config = load_config("tiny-cpu", TINY)
    cache = cc.CacheDir(tmp_path, cc.cache_key(torch.device("cpu")))
    cache.path.mkdir(parents=True)
    cache.blob_path.write_bytes(b"x")
    cache.write_manifest(_manifest(cache.key.text, config_hash(config)))
    assert run_warm(config, tmp_path, if_needed=True, echo=lines.append) == cache.manifest()
    assert "already warm" in lines[-1]
    assert config_hash(load_config("tiny-cpu", [*TINY, "--train.steps=9"])) == config_hash(config)
    assert config_hash(load_config("tiny-cpu", [*TINY, "--data.max_length=128"])) != config_hash(config)


# ------------------------------------------------------------------ the real thing (slow)
def _fab(config: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k.startswith("FLEET_TRAINING")}  # the tiny cache
    env["TMUX_TMPDIR"] = str(config.parent / "tmux")  # a private tmux server, killed at teardown
    return testkit.fab(*args, config=config, env=env, timeout=timeout)


def _wait_for_exit(run_dir: Path, timeout: float = 900) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = run_dir / "exit_code"
        if code.is_file() and code.read_text().strip():
            return int(code.read_text().strip())
        time.sleep(2)
    raise AssertionError(f"run {run_dir} did not finish in {timeout}s: {_tail(run_dir / 'train.log')}")


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.is_file() else f"({path} missing)"


def _cache_events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "compile_cache"]


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory, tiny_cache: Path) -> Iterator[dict[str, Any]]:
    """A local target (the dev venv's python, no managed env) after `fab deploy` + `fab warm`."""
    base = tmp_path_factory.mktemp("warm")
    config = base / "fleet.toml"
    (base / "tmux").mkdir()
    overrides = ", ".join(json.dumps(o) for o in TINY)
    config.write_text(
        f'default_target = "local"\n[targets.local]\nhost = "local"\nworkdir = "{base / "wd"}"\n'
        f'gpus = 0\nenv = ""\n[targets.local.run]\nmodule = "training"\nconfig = "tiny-cpu"\n'
        f'overrides = [{overrides}]\nenv = {{ FLEET_TRAINING_CACHE = "{tiny_cache}" }}\n'
        f'[targets.local.commands]\npython = "{sys.executable}"\n'
    )
    deployed = _fab(config, "deploy")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    warm = _fab(config, "warm")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    roots = list((base / "wd" / "compile-cache").iterdir())
    keys = [p for p in roots if not p.name.startswith(".")]
    assert len(keys) == 1, roots
    yield {"config": config, "workdir": base / "wd", "key_dir": keys[0], "warm": warm, "tiny": tiny_cache}
    tmux = {**os.environ, "TMUX_TMPDIR": str(base / "tmux")}
    subprocess.run(["tmux", "kill-server"], env=tmux, capture_output=True, check=False, timeout=30)


@pytest.mark.slow
def test_fab_warm_writes_a_complete_manifest_and_the_blob(warmed: dict[str, Any]) -> None:
    key_dir: Path = warmed["key_dir"]
    assert key_dir.name == cc.cache_key(torch.device("cpu")).text  # the python that ran it is this one
    manifest = cc.Manifest.from_json((key_dir / cc.MANIFEST_FILE).read_text())
    assert manifest.complete and manifest.key == key_dir.name and manifest.config == "tiny-cpu"
    assert manifest.config_hash == config_hash(load_config("tiny-cpu", TINY))
    assert len(manifest.shapes) == 1 and manifest.shapes[0].length == 64 and manifest.shapes[0].bucket == 0
    assert manifest.counters["fxgraph_miss"] > 0  # it compiled (a fresh cache dir)
    assert (key_dir / cc.BLOB_FILE).stat().st_size == manifest.blob_bytes > 0
    assert any((key_dir / "inductor").iterdir())
    assert "warm [1/1] bucket 0 [0, 65): batch" in warmed["warm"].stdout
    # the target's compiled forward too (compile.target), one forward per shape
    assert manifest.target_compiled and [(s.batch_size, s.length) for s in manifest.target_shapes] == [
        (manifest.shapes[0].batch_size, 64)
    ]
    assert "warm target [1/1]" in warmed["warm"].stdout


@pytest.mark.slow
def test_fab_train_after_fab_warm_reports_hits_and_zero_misses(warmed: dict[str, Any]) -> None:
    started = _fab(warmed["config"], "train")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "already warm" in started.stdout  # the automatic warm-up found a complete manifest
    run_dir = (warmed["workdir"] / "runs" / "latest").resolve()
    assert _wait_for_exit(run_dir) == 0, _tail(run_dir / "train.log")
    events = _cache_events(run_dir)
    assert events, _tail(run_dir / "train.log")
    first = events[0]
    assert first["key"] == warmed["key_dir"].name
    assert first["fxgraph_hit"] > 0 and first["aotautograd_hit"] > 0
    assert first["fxgraph_miss"] == 0 and first["aotautograd_miss"] == 0
    assert events[-1]["fxgraph_miss"] == 0  # nothing compiled later in the run either
    assert "target forward: compiled per bucket shape" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_a_second_target_of_the_same_key_trains_from_the_shipped_artefact(warmed: dict[str, Any]) -> None:
    """`fab warm` brought the artefact back to the controller (.fleet/compile-cache beside the
    inventory); a second target (its own empty workdir, as a second host of the same GPU type)
    gets it pushed by `fab train`: only the manifest and the Mega-Cache blob, in an empty cache
    root. Its warm-up finds the key complete and compiles nothing, the trainer loads the blob
    before its first compile (its entries written into the empty root), the run starts with 0 FX /
    AOT misses, and with compile.fail_on_recompile it pre-warms and then forbids recompiles."""
    key = warmed["key_dir"].name
    store = warmed["config"].parent / ".fleet" / "compile-cache"
    assert f"compile cache {key} kept on the controller" in warmed["warm"].stdout
    assert (store / key / cc.BLOB_FILE).read_bytes() == (warmed["key_dir"] / cc.BLOB_FILE).read_bytes()
    second = warmed["config"].parent / "second.toml"
    second.write_text(
        warmed["config"]
        .read_text()
        .replace("[targets.local", "[targets.second")
        .replace('default_target = "local"', 'default_target = "second"')
        .replace(f'workdir = "{warmed["workdir"]}"', f'workdir = "{warmed["workdir"]}-second"')
    )
    deployed = _fab(second, "deploy")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    started = _fab(second, "train")
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"second: compile cache {key} shipped from the controller" in started.stdout
    assert "already warm" in started.stdout and "warm [1/1]" not in started.stdout  # no compile phase
    run_dir = (Path(f"{warmed['workdir']}-second") / "runs" / "latest").resolve()
    assert _wait_for_exit(run_dir) == 0, _tail(run_dir / "train.log")
    events = _cache_events(run_dir)
    assert events and events[0]["key"] == key, _tail(run_dir / "train.log")
    assert events[0]["fxgraph_hit"] > 0 and events[0]["aotautograd_hit"] > 0
    assert all(e["fxgraph_miss"] == 0 and e["aotautograd_miss"] == 0 for e in events)
    log = (run_dir / "train.log").read_text()
    assert "loaded Mega-Cache blob" in log and "stance fail_on_recompile" in log
    shipped = Path(f"{warmed['workdir']}-second") / "compile-cache" / key
    assert sorted(p.name for p in store.joinpath(key).iterdir()) == sorted(
        [cc.MANIFEST_FILE, cc.BLOB_FILE]
    )  # what was shipped: the blob and its manifest alone
    assert any((shipped / "inductor").iterdir())  # the blob's entries were written into the empty root


def test_prewarm_steps_every_shape_and_leaves_weights_grads_and_rng_alone() -> None:
    """Eager (CPU, compile off): the same code path the compiled warm-up runs, cheaply."""
    from types import SimpleNamespace

    from training.model.drafter import DFlashDrafter, DrafterConfig
    from training.run.warm import StandInTarget, prewarm

    shape_cfg = SimpleNamespace(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=4,
        vocab_size=50,
    )
    target = StandInTarget(shape_cfg, torch.device("cpu"), torch.float32)
    cfg = DrafterConfig(
        num_layers=2,
        block_size=4,
        num_anchors=4,
        sliding_window=8,
        full_attention_layers=(1,),
        mask_token_id=49,
    )
    drafter = DFlashDrafter(cfg, shape_cfg, target.get_input_embeddings(), target.get_output_embeddings())
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rng = torch.random.get_rng_state()
    shapes = [cc.ShapeRecord(0, 3, 16), cc.ShapeRecord(1, 2, 24)]
    lines: list[str] = []
    done = prewarm(
        drafter,
        shapes,
        [0, 17, 25],
        device=torch.device("cpu"),
        hidden_dtype=torch.float32,
        echo=lines.append,
    )
    assert [(s.bucket, s.batch_size, s.length) for s in done] == [(0, 3, 16), (1, 2, 24)]
    assert all(s.seconds >= 0 for s in done)
    assert lines[0].startswith("warm [1/2] bucket 0 [0, 17): batch 3 x 16") and lines[1].startswith(
        "warm [2/2]"
    )
    assert all(p.grad is None for p in drafter.parameters())
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_inductor_cache_key_holds_the_device_index_so_ranks_should_see_cuda0() -> None:
    """Why one warm-up serves every process only when each sees its GPU as cuda:0
    (CUDA_VISIBLE_DEVICES): the FX-graph/AOTAutograd cache key of an input on cuda:5 differs
    from one on cuda:0 (fake tensors: no GPU needed). If torch stops doing that, this fails and
    per-index caveats in training/run/warm.py and docs/reference/workdir.md can go."""
    import torch.fx as fx
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._subclasses.fake_tensor import FakeTensorMode

    pickler = FxGraphCachePickler(fx.symbolic_trace(lambda x: x * 2))
    with FakeTensorMode(allow_non_fake_inputs=True):
        tensors = {d: torch.empty(4, 4, device=d) for d in ("cuda:0", "cuda:5")}
        again = torch.empty(4, 4, device="cuda:0")
    assert pickler.get_hash(tensors["cuda:0"]) == pickler.get_hash(again)
    assert pickler.get_hash(tensors["cuda:0"]) != pickler.get_hash(tensors["cuda:5"])
