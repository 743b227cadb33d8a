"""A run is never lost to a bad checkpoint, end to end through the real test host (`fab` -> SSH ->
pct shim -> LXC container 200) with the real trainer (tiny-cpu) in env local-cpu.

A run stopped by `fab stop` gets its newest checkpoint damaged on the target, as a disk or a copy
would: a few KB overwritten inside it (torch.load does not notice), then, on the next stop, the
file cut short. Each time `fab train` names the bad checkpoint in one line and resumes from the
previous one; the trainer renames the bad one aside (never deletes it) and `fab status` shows it;
the run finishes with every step once. A learning rate that makes the loss overflow fails the run
before it checkpoints that step, with that cause, and the restart policy does not retry it.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import TYPE_CHECKING, Any

import pytest
import testkit

if TYPE_CHECKING:
    from collections.abc import Iterator

    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts

# Room after the second stop (at step 22): with 40 the tiny run could finish before `fab stop` landed
STEPS = 64
RUN = {
    "module": "training",
    "config": "tiny-cpu",
    "overrides": [
        f"--train.steps={STEPS}",
        "--checkpoint.every=4",
        "--checkpoint.keep=3",
        "--train.log_every=1",
        "--eval.num_prompts=0",
        "--data.corpus_files=60",  # a smaller corpus to tokenize in each test's fresh workdir
    ],
    "env": {},
}
UV_CACHE = "/workspace/.fleet-test-uv-cache"  # shared with the other e2e tests: torch is large
RESUMED = re.compile(r"run (\S+) resumed at step (\d+) from checkpoint (\S+)")


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def events(hosts: TestHost, run_dir: str) -> list[dict[str, Any]]:
    path = hosts.ct_path(f"{run_dir}/events.jsonl")
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def last_step(hosts: TestHost, run_dir: str) -> int:
    steps = [e["step"] for e in events(hosts, run_dir) if e["event"] == "step"]
    return steps[-1] if steps else 0


def status(fleet: RemoteFleet) -> dict[str, Any]:
    result = fleet.fab("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def wait_final(fleet: RemoteFleet) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def final() -> bool:
        holder["st"] = status(fleet)
        return holder["st"]["state"] in ("finished", "stopped", "failed") and holder["st"]["alive"] is False

    testkit.wait_for("the run to end", final, timeout=1800, interval=2.0)
    return holder["st"]


def saved_steps(hosts: TestHost, run_dir: str) -> list[int]:
    return sorted(int(p.name[5:13]) for p in hosts.ct_path(f"{run_dir}/checkpoints").glob("step-*.pt"))


def overwrite_inside(hosts: TestHost, path: str) -> None:
    """4 KB overwritten in the middle of the file, its length unchanged (dd on the target)."""
    size = hosts.ct_path(path).stat().st_size
    hosts.pct_exec(
        "dd", "if=/dev/urandom", f"of={path}", "bs=4096", "count=1", f"seek={size // 8192}", "conv=notrunc"
    )


def reach_step(fleet: RemoteFleet, hosts: TestHost, run_dir: str, at: int) -> None:
    """Wait for step ``at`` of the live run; a run that ended first fails the test with its log."""

    def there() -> bool:
        if last_step(hosts, run_dir) >= at:
            return True
        st = status(fleet)
        assert st["alive"] is not False, (st["state"], st["diagnosis"], fleet.fab("logs").stdout[-3000:])
        return False

    testkit.wait_for(f"step {at}", there, timeout=1800, interval=2.0)


def stop_and_damage(
    fleet: RemoteFleet, hosts: TestHost, run_dir: str, at: int, damage: str
) -> tuple[int, int]:
    """Wait for step ``at``, `fab stop`, damage the newest checkpoint; (its step, the one before)."""
    reach_step(fleet, hosts, run_dir, at)
    stopped = fleet.fab("stop")
    if stopped.returncode == 5:  # "still running 60s after SIGTERM": a loaded machine; it is stopping
        wait_final(fleet)
    else:
        ok(stopped)
    saved = saved_steps(hosts, run_dir)
    assert len(saved) >= 2 and saved[-1] < STEPS, saved
    newest = f"{run_dir}/checkpoints/step-{saved[-1]:08d}.pt"
    if damage == "overwrite":
        overwrite_inside(hosts, newest)
    else:
        hosts.pct_exec("truncate", "-s", str(hosts.ct_path(newest).stat().st_size // 2), newest)
    return saved[-1], saved[-2]


@pytest.fixture
def torch_fleet(remote_fleet: RemoteFleet) -> Iterator[RemoteFleet]:
    """remote_fleet whose env (torch: thousands of files) is removed with time to spare first."""
    yield remote_fleet
    remote_fleet.fab("stop", "--force", timeout=120)
    remote_fleet.hosts.pct_exec("rm", "-rf", "--", f"{remote_fleet.workdir}/envs", check=False, timeout=900)


def test_a_bad_checkpoint_is_set_aside_and_a_non_finite_loss_fails_the_run(torch_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = torch_fleet, torch_fleet.hosts, torch_fleet.workdir
    fleet.write(env="local-cpu", uv_cache=UV_CACHE, run=RUN)
    ok(fleet.fab("deploy", "train", "--no-warm", timeout=1200))
    run_id = hosts.pct_exec("readlink", f"{workdir}/runs/latest").stdout.strip()
    run_dir = f"{workdir}/runs/{run_id}"

    resumes = []
    for at, damage, reason in ((9, "overwrite", "sha256 mismatch"), (22, "truncate", "truncated")):
        bad, previous = stop_and_damage(fleet, hosts, run_dir, at, damage)
        resumed = ok(fleet.fab("train", "--no-warm"))
        named = [line for line in resumed.stdout.splitlines() if f"checkpoint step {bad} (" in line]
        assert len(named) == 1 and reason in named[0] and "failed its check" in named[0], resumed.stdout
        m = RESUMED.search(resumed.stdout)
        assert m and m.group(1) == run_id and int(m.group(2)) == previous + 1, resumed.stdout
        assert m.group(3).endswith(f"step-{previous:08d}.pt")
        aside = f"{run_dir}/checkpoints/step-{bad:08d}.pt.bad"
        testkit.wait_for(
            "the bad checkpoint set aside", lambda a=aside: hosts.ct_path(a).exists(), timeout=300
        )
        resumes.append(previous)
        note = f"checkpoint step {bad} failed its check ({reason}"
        testkit.wait_for(  # the event follows once the trainer resumes (after loading data and models)
            "fab status to note it",
            lambda note=note: any(note in n for n in status(fleet)["notes"]),
            timeout=1800,
            interval=2.0,
        )

    st = wait_final(fleet)
    assert (st["run_id"], st["state"], st["step"]) == (run_id, "finished", STEPS), st
    assert [h["step"] for h in st["history"]] == list(range(1, STEPS + 1))  # every step once
    assert [e["step"] for e in events(hosts, run_dir) if e["event"] == "resume"] == resumes
    assert len(list(hosts.ct_path(f"{run_dir}/checkpoints").glob("*.pt.bad"))) == 2  # kept, not deleted

    # A loss that overflows: failed with its cause before that step is saved; never retried.
    overflow = [*RUN["overrides"], "--checkpoint.every=1", "--train.lr=1e12", "--train.warmup_steps=1"]
    fleet.write(run={**RUN, "overrides": overflow, "restart": {"max": 2, "backoff_s": 1}})
    ok(fleet.fab("train", "--no-warm", "--fresh"))
    st2 = wait_final(fleet)
    assert (st2["state"], st2["attempt"]) == ("failed", 1), st2
    assert st2["last_cause"] == "non-finite-loss (not retryable)", st2
    (diag,) = st2["diagnosis"]
    bad_step = int(re.search(r"at step (\d+)", diag["cause"]).group(1))  # type: ignore[union-attr]
    assert diag["signature"] == "non-finite-loss" and bad_step >= 2, diag
    run2_dir = f"{workdir}/runs/{st2['run_id']}"
    assert saved_steps(hosts, run2_dir) == list(range(1, bad_step)), "a checkpoint at or after the bad step"
