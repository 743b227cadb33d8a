"""The launcher's rendezvous: a single node never depends on its hostname resolving, and a
rendezvous that cannot form ends in bounded time with one line (training.launch.launch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import parse_args

from training.launch import loopback_rendezvous, rendezvous_failure

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600  # a launcher still running after this is a hang (not a speed check)
UNRESOLVABLE = "fleet-no-such-host.invalid"  # RFC 2606: .invalid never resolves


def _args(*argv: str):
    return parse_args([*argv, "job.py"])


@pytest.mark.parametrize("given", [[], ["--standalone"], ["--nnodes=1"], ["--nnodes=1:1", "--standalone"]])
def test_a_single_node_rendezvouses_on_loopback(given: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    args = _args(*given, "--nproc-per-node=2")
    assert loopback_rendezvous(args)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.local_addr) == ("c10d", "127.0.0.1:0", "127.0.0.1")
    assert not args.standalone and args.nnodes == "1" and args.rdzv_id
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.parametrize(
    "given",
    [
        ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"],
        ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400"],
        ["--nnodes=1", "--master-addr=10.0.0.1", "--master-port=29500"],
    ],
)
def test_a_named_rendezvous_is_left_as_given(given: list[str]) -> None:
    args = _args(*given)
    before = dict(vars(args))
    assert not loopback_rendezvous(args)
    assert vars(args) == before


def test_rendezvous_failures_are_one_line_with_what_to_check() -> None:
    args = _args(
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-conf=join_timeout=30"
    )
    timeout = rendezvous_failure(RendezvousTimeoutError(), args)
    assert "\n" not in timeout and "10.0.0.1:29400 did not form within 30 s" in timeout
    assert "every node" in timeout
    try:
        raise RendezvousConnectionError("The connection to the C10d store has failed.") from TimeoutError(
            "The client socket has timed out after 60000ms\nmore"
        )
    except RendezvousConnectionError as exc:
        unreachable = rendezvous_failure(exc, args)
    assert "\n" not in unreachable and "cannot reach the rendezvous at 10.0.0.1:29400" in unreachable
    assert "timed out after 60000ms" in unreachable


def _launch(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    full.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.mark.slow
def test_a_rendezvous_that_cannot_form_ends_with_one_line(tmp_path: Path) -> None:
    """Two nodes expected, one started: torchrun gives up after join_timeout; one line, exit 1."""
    launcher = [sys.executable, "-m", "training.launch", "--nproc-per-node=1", "--nnodes=2"]
    rdzv = ["--rdzv-backend=c10d", "--rdzv-conf=join_timeout=3"]
    job = ["-m", "training.selftest", "--run-dir", str(tmp_path / "r")]
    alone = _launch([*launcher, *rdzv, "--rdzv-endpoint=127.0.0.1:0", *job])
    assert alone.returncode == 1, alone.stderr
    lines = alone.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not form within 3 s" in lines[0], alone.stderr
    assert not (tmp_path / "r").exists()  # no rank ever started
    nowhere = _launch([*launcher, *rdzv, f"--rdzv-endpoint={UNRESOLVABLE}:29400", *job])
    assert nowhere.returncode == 1
    assert nowhere.stderr.strip().splitlines() == [nowhere.stderr.strip()], nowhere.stderr
    assert f"rendezvous host '{UNRESOLVABLE}' does not resolve" in nowhere.stderr


def _can_unshare_uts() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    return subprocess.run([unshare, "--uts", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(
    not _can_unshare_uts(), reason="needs `unshare --uts` (root) to give a hostname that never resolves"
)
def test_topology_run_where_the_hostname_does_not_resolve(tiny_cache: Path, tmp_path: Path) -> None:
    """A 1+1 run of the real trainer on a host named so that it cannot resolve (as in a fresh
    debootstrapped container): it trains and exits 0 (torchrun's --standalone retries the name forever)."""
    run_dir = tmp_path / "run"
    train = [sys.executable, "-m", "training.launch", "--nproc-per-node=2", "-m", "training", "train"]
    train += ["--config", "tiny-cpu", "--run-dir", str(run_dir), "--topology", "1+1", "--train.steps=2"]
    train += ["--train.torch_threads=1", "--eval.num_prompts=0", "--checkpoint.every=0"]
    script = 'hostname "$1" && shift && exec "$@"'
    argv = ["unshare", "--uts", "sh", "-c", script, "fleet-rdzv", UNRESOLVABLE, *train]
    done = _launch(
        argv, env={"FLEET_TRAINING_CACHE": str(tiny_cache), "FLEET_DATA_CACHE": str(tiny_cache / "data")}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cannot be retrieved" not in done.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "run_start"]
    assert len(starts) == 2 and {e["host"] for e in starts} == {UNRESOLVABLE}
    assert [e["phase"] for e in events if e["event"] == "phase"][-1] == "done"
