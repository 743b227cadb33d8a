"""Runs that survive: `fab train` resumes the latest run, end to end through the real test host
(`fab` -> SSH -> pct shim -> LXC container 200) with the real trainer (tiny-cpu) in env local-cpu.

One deploy, three launches of a short run: stopped by `fab stop` at step k, `fab train` resumes at
k+1; killed by `fab stop --force` (SIGKILL), `fab train` resumes after the last checkpoint; it
finishes. A changed drafter setting is refused before launch in one line naming the key. Then a
plain `fab train` starts a new run (the latest one finished) with `restart = { max = 2 }`: its
trainer killed mid-run comes back by itself (attempt 2) and finishes, logging the very losses of
the first run at every step (interrupted elsewhere); a config error is not retried.

A bad checkpoint never loses a run: stopped by `fab stop`, the newest checkpoint is damaged on the
target as a disk or a copy would (a few KB overwritten inside it, which torch.load does not notice;
then, on the next stop, the file cut short). Each time `fab train` names the bad checkpoint in one
line and resumes from the previous one; the trainer renames the bad one aside (never deletes it)
and `fab status` shows it; the run finishes with every step once. A learning rate that makes the
loss overflow fails the run before it checkpoints that step, with that cause, not retried.

The user's own data: a SpecForge-format file and a raw ShareGPT file, unchanged, reported by `fab
data` and trained by `fab deploy train`.

The scenarios share one workdir (their env, torch's thousands of files, built once by the first
deploy); each starts from the target as first written and a fresh run, and leaves no live run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import statuspoll
import testkit

from fleet.inventory import STALL_WINDOW_S

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from testkit import RemoteFleet, TestHost

pytestmark = pytest.mark.hosts

# Room for `fab stop --force` to land after step k+8 (k: where `fab stop` landed, ~13 steps after
# step 8 at ~0.3 s a step): with 40 the resumed run finished first in a CI run
STEPS = 64
RUN = {
    "module": "training",
    "config": "tiny-cpu",
    "overrides": [
        f"--train.steps={STEPS}",
        "--checkpoint.every=5",
        "--checkpoint.keep=3",
        "--train.log_every=1",
        "--eval.num_prompts=0",
        *testkit.ONE_THREAD,
    ],
    "env": {},
}
# The env's packages come from a uv cache kept in the container across tests (torch is large).
UV_CACHE = "/workspace/.fleet-test-uv-cache"
RESUMED = re.compile(r"run (\S+) resumed at step (\d+) from checkpoint (\S+)")


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def ct_read(hosts: TestHost, path: str) -> str:
    result = hosts.pct_exec("cat", "--", path, check=False)
    return result.stdout if result.returncode == 0 else ""


def events(hosts: TestHost, run_dir: str) -> list[dict[str, Any]]:
    lines = ct_read(hosts, f"{run_dir}/events.jsonl").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def last_step(hosts: TestHost, run_dir: str) -> int:
    steps = [e["step"] for e in events(hosts, run_dir) if e["event"] == "step"]
    return steps[-1] if steps else 0


def status(fleet: RemoteFleet) -> dict[str, Any]:
    result = fleet.fab("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def wait_final(fleet: RemoteFleet) -> dict[str, Any]:
    def final(st: dict[str, Any]) -> bool:
        return st["state"] in ("finished", "stopped", "failed") and st["alive"] is False

    return testkit.wait_status(fleet, lambda: status(fleet), final, "the run to end")


def trainer_pids(run_dir: str) -> list[int]:
    """Host-view PIDs of the trainer processes (python ... training train) of ``run_dir``; not run.sh."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if (
            argv
            and b"python" in argv[0].rsplit(b"/", 1)[-1]
            and b"train" in argv
            and run_dir.encode() in argv
        ):
            pids.append(int(proc.name))
    return pids


HOOK = """
import http.server, json, os, sys
out = sys.argv[1]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(out, "a") as fh:
            fh.write(json.dumps({"path": self.path, "headers": dict(self.headers), "body": body}) + "\\n")
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
with open(out + ".pid", "w") as fh:
    fh.write(str(os.getpid()))
with open(out + ".port", "w") as fh:
    fh.write(str(server.server_address[1]))
server.serve_forever()
"""


def start_hook(hosts: TestHost, out: str) -> tuple[subprocess.Popen[bytes], int]:
    """A real HTTP server on the container's 127.0.0.1 (the notifier runs there) recording each POST."""
    hosts.ct_path("/tmp/fleet-test-hook.py").write_text(HOOK)
    proc = subprocess.Popen(
        [hosts.pct, "exec", str(hosts.ct_id), "--", "python3", "/tmp/fleet-test-hook.py", out]
    )
    port_file = hosts.ct_path(out + ".port")
    testkit.wait_for(
        "the webhook server", lambda: port_file.exists() and bool(port_file.read_text()), timeout=30
    )
    return proc, int(port_file.read_text())


def command_lines() -> list[bytes]:
    """Every process's command line on this machine (the container's processes are among them)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            found.append((proc / "cmdline").read_bytes() if proc.name.isdigit() else b"")
        except OSError:
            continue
    return found


def received(hosts: TestHost, out: str) -> list[dict[str, Any]]:
    path = hosts.ct_path(out)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def shared_fleet(hosts: TestHost, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteFleet]:
    """One workdir for the module's scenarios; its env (torch: thousands of files) removed with
    time to spare first."""
    with testkit.remote_fleet_at(hosts, tmp_path_factory.mktemp("lifecycle")) as fleet:
        yield fleet
        fleet.fab("stop", "--force", timeout=120)
        hosts.pct_exec("rm", "-rf", "--", f"{fleet.workdir}/envs", check=False, timeout=900)


@pytest.fixture
def torch_fleet(shared_fleet: RemoteFleet) -> Iterator[RemoteFleet]:
    """The shared workdir with the target as first written; no run left live after the test."""
    shared_fleet.write(**shared_fleet.defaults)
    yield shared_fleet
    shared_fleet.fab("stop", "--force", timeout=120)


def test_resume_restart_and_notify_through_fab(torch_fleet: RemoteFleet, tmp_path: Path) -> None:
    """Beside every step, from the first launch to the last run's end, a second process reads
    `fab status --json` and samples the truth around each reading (tests/statuspoll.py), as fast
    as it answers through each transition (a stop, a relaunch's start-up, a kill, the restart
    policy's back-off, a stall, a run's end), every few seconds between them: no reading may name
    a state the run was not in."""
    fleet, hosts, workdir = torch_fleet, torch_fleet.hosts, torch_fleet.workdir
    fleet.write(env="local-cpu", uv_cache=UV_CACHE, run=RUN)
    ok(fleet.fab("deploy", "train", "--no-warm", timeout=1200))
    out = tmp_path / "poll.jsonl"

    def truthful(where: str) -> None:
        """Every reading so far named a state the run was in (at the step ``where``)."""
        bad = statuspoll.violations(statuspoll.read_lines(out), STALL_WINDOW_S)
        assert not bad, f"{where}: {len(bad)} reading(s) untrue, the first: " + "\n".join(bad[:3])

    with statuspoll.polling(fleet.config, hosts.ct_path(f"{workdir}/runs"), out) as watch:
        lifecycle(fleet, truthful, watch)
    truthful("the end")
    seen = {r["reading"]["state"] for r in statuspoll.read_lines(out)}
    assert {"starting", "training", "stopped", "failed", "finished"} <= seen, seen


def stepped_past(hosts: TestHost, run_dir: str, step: int) -> None:
    """Wait until the run logged a step after ``step`` (a relaunch's start-up is over)."""
    testkit.wait_for(
        f"a step after {step}", lambda: last_step(hosts, run_dir) > step, timeout=300, interval=0.3
    )


def final_closely(fleet: RemoteFleet, run_dir: str, watch: statuspoll.Watch) -> dict[str, Any]:
    """The run's end, read closely from its last few steps on."""
    hosts = fleet.hosts
    testkit.wait_for(
        "the last steps", lambda: last_step(hosts, run_dir) >= STEPS - 3, timeout=300, interval=0.3
    )
    with watch.closely():
        return wait_final(fleet)


def lifecycle(fleet: RemoteFleet, truthful: Callable[[str], None], watch: statuspoll.Watch) -> None:
    hosts, workdir = fleet.hosts, fleet.workdir
    run_id = hosts.pct_exec("readlink", f"{workdir}/runs/latest").stdout.strip()
    run_dir = f"{workdir}/runs/{run_id}"

    # 1. `fab stop` (SIGTERM: the step finishes and is checkpointed) at some step k; resume at k+1.
    testkit.wait_for("step 8", lambda: last_step(hosts, run_dir) >= 8, timeout=300, interval=0.3)
    with watch.closely():
        ok(fleet.fab("stop"))
        k = last_step(hosts, run_dir)
        assert k < STEPS, "the run finished before it was stopped"
        resumed = ok(fleet.fab("train", "--no-warm"))
        m = RESUMED.search(resumed.stdout)
        assert m and m.group(1) == run_id and int(m.group(2)) == k + 1, resumed.stdout
        assert m.group(3).endswith(f"step-{k:08d}.pt")
        stepped_past(hosts, run_dir, k)

    # 2. kill -9 (`fab stop --force`) after some more steps; resume after the last checkpoint.
    testkit.wait_for("more steps", lambda: last_step(hosts, run_dir) >= k + 8, timeout=300, interval=0.3)
    truthful("stop, resume")
    with watch.closely():
        killed = fleet.fab("stop", "--force")
        assert killed.returncode == 0, killed.stderr
        # The newest complete checkpoint file: written in the background, its event follows the
        # file, so a kill can land between the two.
        files = hosts.ct_path(f"{run_dir}/checkpoints").glob("step-*.pt")
        saved = sorted(int(p.stem.split("-")[1]) for p in files)
        checkpointed = max(e["step"] for e in events(hosts, run_dir) if e["event"] == "checkpoint")
        assert saved and saved[-1] >= checkpointed
        assert last_step(hosts, run_dir) < STEPS, "the run finished before it was killed"
        assert status(fleet)["state"] == "failed"
        again = ok(fleet.fab("train", "--no-warm"))
        m = RESUMED.search(again.stdout)
        assert m and m.group(1) == run_id and int(m.group(2)) == saved[-1] + 1, again.stdout
        stepped_past(hosts, run_dir, saved[-1])

    st = final_closely(fleet, run_dir, watch)
    assert (st["run_id"], st["state"], st["step"]) == (run_id, "finished", STEPS), st
    truthful("kill -9, resume, finish")
    steps = [h["step"] for h in st["history"]]
    assert steps == list(range(1, STEPS + 1)), steps  # one history: no step twice, none missing
    assert st["segments"] == 3 and st["resumed_from"] == saved[-1], st
    assert st["checkpoint_s"] is not None and st["tokens_per_s"], st
    resumes = [e["step"] for e in events(hosts, run_dir) if e["event"] == "resume"]
    assert resumes == [k, saved[-1]]
    launches = ct_read(hosts, f"{run_dir}/segments.jsonl").splitlines()
    assert [json.loads(line)["segment"] for line in launches] == [1, 2, 3]
    # One tokenized data cache for the workdir, none inside the run dir.
    assert hosts.pct_exec("test", "-d", f"{workdir}/data-cache", check=False).returncode == 0
    assert hosts.pct_exec("test", "-e", f"{run_dir}/data-cache", check=False).returncode == 1

    # 3. Continuing a run with a changed drafter setting is refused before launch, naming the key.
    fleet.write(run={**RUN, "overrides": [*RUN["overrides"], "--drafter.num_layers=1"]})
    refused = fleet.fab("train", "--no-warm", "--from", run_id)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = one_line(refused)
    assert "drafter.num_layers 2 -> 1" in line and "--fresh" in line, line
    assert len(ct_read(hosts, f"{run_dir}/segments.jsonl").splitlines()) == 3  # nothing launched

    # 4. The latest run finished: a plain `fab train` starts a new one. Restart policy +
    # notifications: its trainer killed mid-run (not the wrapper) comes back by itself and resumes
    # from its checkpoint; `fab status` shows attempt 2 and why attempt 1 ended. It must log the
    # very losses of the first run, which was stopped and killed at other steps (an uninterrupted
    # run against a resumed one, in process: tests/training/run/test_resume.py).
    # A webhook on the container's loopback gets restarted, stalled (the trainer frozen by SIGSTOP
    # for longer than stall_window_s) and finished; its URL token and header never leak.
    out = f"/tmp/{workdir.rsplit('/', 1)[-1]}-hook.jsonl"
    hook, port = start_hook(hosts, out)
    # random: another checkout's suite on this machine may run this test at the same time
    token, bearer = f"tok-{uuid.uuid4().hex[:8]}", f"hdr-{uuid.uuid4().hex[:6]}"
    notify = {
        "url": f"http://127.0.0.1:{port}/hook/{token}",
        "headers": {"Authorization": f"Bearer {bearer}"},
    }
    fleet.write(run={**RUN, "restart": {"max": 2, "backoff_s": 1}}, notify=notify, stall_window_s=6)
    try:
        with watch.closely():  # a new run after the finished one: its start-up
            fresh = ok(fleet.fab("train", "--no-warm"))
            assert "finished" in fresh.stdout and "started" in fresh.stdout, fresh.stdout
            run3 = hosts.pct_exec("readlink", f"{workdir}/runs/latest").stdout.strip()
            assert run3 != run_id
            run3_dir = f"{workdir}/runs/{run3}"
            stepped_past(hosts, run3_dir, 0)
        testkit.wait_for("step 7", lambda: last_step(hosts, run3_dir) >= 7, timeout=300, interval=0.3)
        release3 = json.loads(ct_read(hosts, f"{run3_dir}/run.json"))["release"]
        redeployed = ok(fleet.fab("deploy"))  # while the run is live: it stays on its release
        assert f"the live run stays on release {release3}" in redeployed.stdout, redeployed.stdout
        with watch.closely():  # the kill, the policy's back-off, attempt 2's start-up, a stall
            for pid in trainer_pids(run3_dir):
                os.kill(pid, 9)
            testkit.wait_for(
                "attempt 2's steps", lambda: status(fleet)["attempt"] == 2, timeout=300, interval=1
            )
            testkit.wait_for(
                "a step of attempt 2",
                lambda: (
                    len(trainer_pids(run3_dir)) == 1
                    and '"resume"' in ct_read(hosts, f"{run3_dir}/events.jsonl")
                ),
                timeout=300,
                interval=0.5,
            )
            frozen, frozen_at = trainer_pids(run3_dir), last_step(hosts, run3_dir)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                testkit.wait_for(
                    "the stalled notification",
                    lambda: "stalled" in [r["body"]["state"] for r in received(hosts, out)],
                    timeout=120,
                )
                cmdlines = command_lines()
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            stepped_past(hosts, run3_dir, frozen_at)  # the stall is over
        st3 = final_closely(fleet, run3_dir, watch)
        truthful("a new run, its trainer killed, restarted by the policy, finished")
        assert (st3["run_id"], st3["state"], st3["step"]) == (run3, "finished", STEPS), st3
        assert (st3["attempt"], st3["last_cause"]) == (2, "exit 137"), st3
        assert [h["step"] for h in st3["history"]] == steps and st3["segments"] == 2
        assert [h["loss"] for h in st3["history"]] == [h["loss"] for h in st["history"]]
        testkit.wait_for(
            "the finished notification",
            lambda: received(hosts, out)[-1]["body"]["state"] == "finished",
            timeout=60,
        )
        listed = json.loads(ok(fleet.fab("runs", "--json")).stdout)
        assert [(r["run_id"], r["state"], r["step"], r["launches"]) for r in listed] == [
            (run_id, "finished", STEPS, 3),
            (run3, "finished", STEPS, 1),  # one `fab train`: attempt 2 is the wrapper's own
        ]
        assert listed[1]["latest"] and listed[0]["size_kib"] > 0

        # 5. A config error is never retried; the webhook hears `failed`. One the controller can
        # read (an unknown key) is refused before anything starts; one only the target can see (a
        # model folder that is not there) ends the run with exit 2, not retried.
        unknown = [*RUN["overrides"], "--train.no_such_key=1"]
        fleet.write(run={**RUN, "overrides": unknown, "restart": {"max": 2, "backoff_s": 1}})
        refused = fleet.fab("train", "--no-warm", "--fresh")
        assert refused.returncode == 2 and "--train.no_such_key: unknown key" in refused.stderr, refused
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
        bad = [*RUN["overrides"], "--model.kind=pretrained", "--model.path=/nonexistent/model"]
        fleet.write(run={**RUN, "overrides": bad, "restart": {"max": 2, "backoff_s": 1}})
        with watch.closely():  # a launch that fails in its start-up
            ok(fleet.fab("train", "--no-warm", "--fresh"))
            st4 = wait_final(fleet)
        assert (st4["state"], st4["process_exit_code"], st4["attempt"]) == ("failed", 2, 1), st4
        assert st4["last_cause"] == "config-error (not retryable)", st4
        testkit.wait_for(
            "the failed notification",
            lambda: received(hosts, out)[-1]["body"]["state"] == "failed",
            timeout=60,
        )
    finally:
        hosts.pct_exec("kill", hosts.ct_path(out + ".pid").read_text().strip(), check=False)
        hook.wait(timeout=30)
    got = received(hosts, out)
    states = [r["body"]["state"] for r in got]
    # (a slow start-up may be reported as a stall too, of either run: stall_window_s is short here)
    ends = [state for state in states if state != "stalled"]
    assert ends == ["restarted", "finished", "failed"] and "stalled" in states, states
    by_state = {r["body"]["state"]: r["body"] for r in got}
    assert by_state["restarted"]["run"] == run3 and by_state["restarted"]["cause"].startswith("exit 137")
    assert by_state["finished"]["step"] == STEPS and by_state["failed"]["cause"].startswith("exit 2")
    assert set(by_state["failed"]) == {"target", "run", "state", "step", "cause", "fix"}
    for r in got:
        assert r["path"] == f"/hook/{token}" and r["headers"]["Authorization"] == f"Bearer {bearer}"
        assert token not in json.dumps(r["body"]) and bearer not in json.dumps(r["body"])
    assert not [c for c in cmdlines if token.encode() in c or bearer.encode() in c], (
        "a command line shows a secret"
    )
    for path in [
        *hosts.ct_path(f"{workdir}/runs").rglob("*"),
        *hosts.ct_path(f"{workdir}/releases").rglob("*"),
    ]:
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert token.encode() not in data and bearer.encode() not in data, path


# Room after the second stop (at step 22): with 40 the tiny run could finish before `fab stop` landed
CKPT_STEPS = 64
# The lifecycle's data (the tiny corpus): tokenized once into the workdir's data cache, read here
CKPT_RUN = {
    "module": "training",
    "config": "tiny-cpu",
    "overrides": [
        f"--train.steps={CKPT_STEPS}",
        "--checkpoint.every=4",
        "--checkpoint.keep=3",
        "--train.log_every=1",
        "--eval.num_prompts=0",
        *testkit.ONE_THREAD,
    ],
    "env": {},
}


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
        if testkit.processes_with(run_dir):  # alive: no `fab status` (~1 s of CPU) needed to say so
            return False
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
    assert len(saved) >= 2 and saved[-1] < CKPT_STEPS, saved
    newest = f"{run_dir}/checkpoints/step-{saved[-1]:08d}.pt"
    if damage == "overwrite":
        overwrite_inside(hosts, newest)
    else:
        hosts.pct_exec("truncate", "-s", str(hosts.ct_path(newest).stat().st_size // 2), newest)
    return saved[-1], saved[-2]


def test_a_bad_checkpoint_is_set_aside_and_a_non_finite_loss_fails_the_run(torch_fleet: RemoteFleet) -> None:
    fleet, hosts, workdir = torch_fleet, torch_fleet.hosts, torch_fleet.workdir
    fleet.write(env="local-cpu", uv_cache=UV_CACHE, run=CKPT_RUN)
    ok(fleet.fab("deploy", "train", "--no-warm", "--fresh", timeout=1200))
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
    assert (st["run_id"], st["state"], st["step"]) == (run_id, "finished", CKPT_STEPS), st
    assert [h["step"] for h in st["history"]] == list(range(1, CKPT_STEPS + 1))  # every step once
    assert [e["step"] for e in events(hosts, run_dir) if e["event"] == "resume"] == resumes
    assert len(list(hosts.ct_path(f"{run_dir}/checkpoints").glob("*.pt.bad"))) == 2  # kept, not deleted

    # A loss that overflows: failed with its cause before that step is saved; never retried.
    overflow = [*CKPT_RUN["overrides"], "--checkpoint.every=1", "--train.lr=1e12", "--train.warmup_steps=1"]
    fleet.write(run={**CKPT_RUN, "overrides": overflow, "restart": {"max": 2, "backoff_s": 1}})
    ok(fleet.fab("train", "--no-warm", "--fresh"))
    st2 = wait_final(fleet)
    assert (st2["state"], st2["attempt"]) == ("failed", 1), st2
    assert st2["last_cause"] == "non-finite-loss (not retryable)", st2
    (diag,) = st2["diagnosis"]
    bad_step = int(re.search(r"at step (\d+)", diag["cause"]).group(1))  # type: ignore[union-attr]
    assert diag["signature"] == "non-finite-loss" and bad_step >= 2, diag
    run2_dir = f"{workdir}/runs/{st2['run_id']}"
    assert saved_steps(hosts, run2_dir) == list(range(1, bad_step)), "a checkpoint at or after the bad step"


DATA_STEPS = 4
QUESTIONS = [f"Write a function that returns {i} times its argument." for i in range(24)]


def _specforge(i: int, q: str) -> dict[str, Any]:
    turns = [("user", q), ("assistant", f"def times_{i}(x):\n    return {i} * x\n"), ("user", "And a test?")]
    turns.append(("assistant", f"assert times_{i}(2) == {2 * i}\n"))
    return {"id": f"s{i}", "conversations": [{"role": r, "content": c} for r, c in turns]}


def _sharegpt(i: int, q: str) -> dict[str, Any]:
    roles = {"user": "human", "assistant": "gpt"}
    turns = _specforge(i, q)["conversations"]
    return {
        "id": f"g{i}",
        "conversations": [{"from": roles[t["role"]], "value": t["content"]} for t in turns],
    }


@pytest.mark.slow
def test_specforge_and_sharegpt_files_train_through_fab(torch_fleet: RemoteFleet) -> None:
    fleet, hosts = torch_fleet, torch_fleet.hosts
    data_dir = f"{fleet.workdir}-data"
    local = hosts.ct_path(data_dir)
    local.mkdir(parents=True)
    try:
        for fmt, make in (("specforge", _specforge), ("sharegpt", _sharegpt)):
            path = local / f"{fmt}.jsonl"
            path.write_text("".join(json.dumps(make(i, q)) + "\n" for i, q in enumerate(QUESTIONS)))
            overrides = [
                f"--train.steps={DATA_STEPS}",
                "--eval.num_prompts=0",
                f"--data.path={data_dir}/{fmt}.jsonl",
                *testkit.ONE_THREAD,
            ]
            fleet.write(
                env="local-cpu", uv_cache=UV_CACHE, run={"config": "tiny-cpu", "overrides": overrides}
            )
            report = ok(fleet.fab("deploy", "data", timeout=1200)).stdout
            assert f"format {fmt}: 24 records, 24 kept" in report and "Batches per epoch:" in report, report
            ok(fleet.fab("train", "--no-warm", "--fresh", timeout=600))
            st = wait_final(fleet)
            assert (st["state"], st["step"]) == ("finished", DATA_STEPS), st
    finally:
        hosts.pct_exec("rm", "-rf", "--", data_dir, check=False)
