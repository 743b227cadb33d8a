"""Fault suite: faults and bad inputs replayed through the real `fab` against the test host (SSH ->
pct shim -> LXC container 200, /bin/sh = dash there) with the selftest run, then one table:

    fault | faults | runs/checkpoints lost | secrets seen | tracebacks shown | wrong cause

A row is one scenario; "faults" is how many distinct fault cases it tried (a row that damages five
state files one after the other tries five), and the total counts faults, not rows.

    .venv/bin/python benchmarks/fault_suite.py [--only NAME,...] [--skip NAME,...]

Needs tests/hosts/setup to have run. Every run carries a secret in run.env, and the notifier a
token in its URL and a header; "secrets seen" counts each of them found in `ps` of the host
(sampled all along), in fab's output (status JSON included), or in any file of the container that
changed during the suite (train.log, events.jsonl, run dirs ...). "tracebacks shown" counts fab
outputs with a Python traceback; "wrong cause" counts answers that do not name the fault for what
it is (each scenario checks its own). Rows of faults owned elsewhere and not yet on this branch are
printed as `pending`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from testkit import FAB, _host_problem, ct200_target, kill_processes_naming, render_inventory  # noqa: E402

LONG_RUN = ["--selftest.steps=100000", "--selftest.step_seconds=0.2"]
SHORT_RUN = ["--selftest.steps=6", "--selftest.step_seconds=0.05"]
FINAL = ("finished", "stopped", "failed")
TRACEBACK = "Traceback (most recent call last)"
# What a scenario returns: runs/checkpoints lost, answers naming the wrong cause, a note, and (when
# it tries several distinct faults) how many; the table counts faults, not scenarios.
Outcome = tuple[int, int, str] | tuple[int, int, str, int]


@dataclass
class Row:
    fault: str
    faults: int = 1  # the distinct fault cases the row tried
    lost: int = 0
    secrets: int = 0
    tracebacks: int = 0
    wrong: int = 0
    note: str = ""
    pending: bool = False


@dataclass
class Suite:
    hosts: Any
    tmp: Path
    secret: str = field(default_factory=lambda: f"runsecret-{uuid.uuid4().hex}")
    url_token: str = field(default_factory=lambda: f"urltoken-{uuid.uuid4().hex}")
    header_token: str = field(default_factory=lambda: f"hdrtoken-{uuid.uuid4().hex}")
    outputs: list[str] = field(default_factory=list)
    ps_lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.label = f"fleet-fault-{uuid.uuid4().hex[:8]}"
        self.workdir = f"/workspace/{self.label}"
        self.tmux = f"/tmp/{self.label}-tmux"
        wrapper = self.hosts.ct_path(self.tmux)
        wrapper.write_text(f'#!/bin/sh\nexec tmux -L {self.label} "$@"\n')
        wrapper.chmod(0o755)
        self.config = self.tmp / "fleet.toml"
        self.reset()
        self.base_config = self.tmp / "base.toml"
        self.base_config.write_text(self.config.read_text())

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.secret, self.url_token, self.header_token)

    def reset(self, **changes: Any) -> None:
        target = ct200_target(self.hosts, self.workdir)
        target["commands"] = {**target["commands"], "tmux": self.tmux}
        target["run"] = {
            "module": "training.selftest",
            "config": "selftest",
            "overrides": LONG_RUN,
            "env": {"FLEET_FAULT_SECRET": self.secret},
        }
        # A webhook nobody answers (port 9 on this host): deliveries fail, their lines must be clean.
        target["notify"] = {
            "url": f"http://127.0.0.1:9/hook/{self.url_token}",
            "headers": {"Authorization": f"Bearer {self.header_token}"},
        }
        target.update(changes)
        self.target = target
        self.config.write_text(render_inventory({"ct200": target}, "ct200"))

    def fab_env(self, config: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(FLEET_CONFIG=str(config or self.config), PYTHONUNBUFFERED="1")
        return env

    def fab(
        self, *args: str, timeout: float = 180, config: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [str(FAB), *args],
            cwd=REPO,
            env=self.fab_env(config),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        self.outputs.append(res.stdout + res.stderr)
        if TRACEBACK in res.stdout + res.stderr:  # kept whole: the table only counts them
            with (self.tmp / "tracebacks.txt").open("a", encoding="utf-8") as fh:
                fh.write(f"$ fab {' '.join(args)}\n{res.stdout}{res.stderr}\n")
        return res

    def fab_popen(self, *args: str) -> subprocess.Popen[str]:
        """`fab ARGS` started, its output piped (the caller waits, signals or kills it)."""
        return subprocess.Popen(
            [str(FAB), *args],
            cwd=REPO,
            env=self.fab_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def fab_at_once(self, *args: str, times: int = 3, timeout: float = 180) -> list[tuple[int, str]]:
        """``times`` `fab ARGS` started together; each one's exit code and output, in start order."""
        procs = [self.fab_popen(*args) for _ in range(times)]
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            self.outputs.append(out + err)
            done.append((p.returncode, out + err))
        return done

    def status(self) -> dict[str, Any]:
        res = self.fab("status", "--json")
        try:
            data = json.loads(res.stdout)
        except json.JSONDecodeError:
            return {"state": "?", "raw": res.stdout + res.stderr}
        return data if isinstance(data, dict) else {"state": "?"}

    def ct(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.hosts.pct_exec(*argv, check=False, timeout=timeout)

    def runs(self) -> list[str]:
        out = self.ct("ls", "-A", "--", f"{self.workdir}/runs").stdout.split()
        return [n for n in out if n != "latest" and not n.startswith(".")]

    def latest(self) -> str:
        return self.ct("readlink", "--", f"{self.workdir}/runs/latest").stdout.strip()

    def wait(self, check: Callable[[], bool], timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.3)
        return False

    def trainers(self, run_dir: str) -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"python" in argv[0].rsplit(b"/", 1)[-1] and any(run_dir.encode() in a for a in argv):
                    if b"training.selftest" in argv:
                        found.append(int(proc.name))
        return found

    def stop_all(self) -> None:
        self.fab("stop", "--force", timeout=60, config=self.base_config)
        self.ct(self.tmux, "kill-server")
        kill_processes_naming(self.workdir)

    def cleanup(self) -> None:
        self.stop_all()
        self.ct("rm", "-rf", "--", self.workdir, self.tmux, timeout=900)  # a torch env: many files


# ------------------------------------------------------------------ scenarios (each: lost, wrong, note)


def tmux_dies(s: Suite) -> Outcome:
    s.reset(keep_runs=1)
    s.fab("deploy", "train", "--no-warm")
    run_id = s.latest()
    run_dir = f"{s.workdir}/runs/{run_id}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    s.ct(s.tmux, "kill-server")
    time.sleep(1)
    wrong = int(s.status().get("state") != "training")
    wrong += int(s.fab("train", "--no-warm").returncode != 5)
    wrong += int(s.fab("train", "--no-warm", "--fresh").returncode != 5)
    wrong += int(len(s.trainers(run_dir)) != 1)
    lost = int(run_id not in s.runs())
    stop = s.fab("stop")
    wrong += int(stop.returncode != 0 or not s.wait(lambda: not s.trainers(run_dir), 30))
    return lost, wrong, "status training, train/--fresh refused, stop reached it"


CUTTING_PCT = """#!{python}
import os, subprocess, sys
real = {real!r}
if "fleet-run-launch" in sys.argv:
    data = sys.stdin.buffer.read()
    sys.exit(subprocess.run([real, *sys.argv[1:]], input=data[: len(data) // 2]).returncode)
os.execv(real, [real, *sys.argv[1:]])
"""


def launch_connection_drops(s: Suite) -> Outcome:
    s.reset()
    s.fab("deploy")
    cutting = s.tmp / "cutting-pct"
    cutting.write_text(CUTTING_PCT.format(python=sys.executable, real=s.hosts.pct))
    cutting.chmod(0o755)
    s.reset(commands={**ct200_target(s.hosts, s.workdir)["commands"], "tmux": s.tmux, "pct": str(cutting)})
    cut = s.fab("train", "--no-warm")
    wrong = int(cut.returncode != 5 or "arrived incomplete" not in cut.stderr)
    wrong += int(s.runs() != [])
    s.reset()
    whole = s.fab("train", "--no-warm")
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    pids = s.trainers(run_dir)
    env = Path(f"/proc/{pids[0]}/environ").read_bytes() if pids else b""
    wrong += int(whole.returncode != 0 or f"FLEET_FAULT_SECRET={s.secret}".encode() not in env)
    s.stop_all()
    return 0, wrong, "refused, nothing left; the retry started whole"


def env_switched_under_run(s: Suite) -> Outcome:
    s.reset()
    for build in ("fault-aaaaaaaaaaaa", "fault-bbbbbbbbbbbb"):
        s.ct("mkdir", "-p", f"{s.workdir}/envs/{build}/bin")
        s.ct("ln", "-sfn", "/usr/bin/python3", f"{s.workdir}/envs/{build}/bin/python3")
    s.ct("mkdir", "-p", f"{s.workdir}/envs/fault")
    s.ct("ln", "-sfn", "../fault-aaaaaaaaaaaa", f"{s.workdir}/envs/fault/current")
    commands = {**ct200_target(s.hosts, s.workdir)["commands"], "tmux": s.tmux}
    s.reset(commands={**commands, "python": f"{s.workdir}/envs/fault/current/bin/python3"})
    s.fab("deploy", "train", "--no-warm")
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    s.ct("ln", "-sfn", "../fault-bbbbbbbbbbbb", f"{s.workdir}/envs/fault/current")
    pids = s.trainers(run_dir)
    argv0 = (Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")[0]) if pids else b""
    s.stop_all()
    return 0, int(b"fault-aaaaaaaaaaaa" not in argv0), "the run kept its env build"


def notify_bad_url(s: Suite) -> Outcome:
    s.reset(notify={"url": f"https://hooks.example/{s.url_token}\x01"})
    res = s.fab("status")
    return (
        0,
        int(res.returncode != 2 or "notify.url" not in res.stderr),
        "inventory: one line naming notify.url",
    )


def notify_bad_header(s: Suite) -> Outcome:
    s.reset(notify={"url": "https://hooks.example/x", "headers": {"X-Token": f"{s.header_token}\u2603"}})
    res = s.fab("status")
    ok = res.returncode == 2 and "notify.headers.X-Token" in res.stderr
    return 0, int(not ok), "inventory: one line naming the header"


def notify_hangs(s: Suite) -> Outcome:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": SHORT_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret},
        },
        notify={"command": ["sleep", "600"]},
    )
    s.fab("deploy", "train", "--no-warm")
    done = s.wait(lambda: s.status().get("state") == "finished", 40)
    s.stop_all()
    return 0, int(not done), "finished while the command hung"


def group_kill_9(s: Suite) -> Outcome:
    s.reset()
    s.fab("deploy", "train", "--no-warm")
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    pgid = s.ct("cat", f"{run_dir}/pgid").stdout.strip()
    s.ct("kill", "-s", "KILL", "--", f"-{pgid}")
    s.wait(lambda: s.status().get("state") in FINAL, 30)
    st = s.status()
    code = st.get("process_exit_code")
    wrong = int(st.get("state") != "failed" or code not in (137, None))
    lost = int(s.latest() not in s.runs())
    return lost, wrong, f"failed, exit {code}"


def dangling_latest(s: Suite) -> Outcome:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": SHORT_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy", "train", "--no-warm")
    real = s.latest()
    s.wait(lambda: s.status().get("state") in FINAL, 40)
    s.ct("ln", "-sfn", "29990101T000000Z-removed", f"{s.workdir}/runs/latest")
    st = s.status()
    return int(real not in s.runs()), int(st.get("run_id") != real), "status names the newest run dir"


def watch_ssh_drop(s: Suite) -> Outcome:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": ["--selftest.steps=40", "--selftest.step_seconds=0.2"],
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy", "train", "--no-warm")
    watch = subprocess.Popen(
        [str(FAB), "status", "--watch", "0.5", "--json"],
        cwd=REPO,
        env=s.fab_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    watch.stdout.readline()
    master = Path(s.hosts.sshd_pidfile).read_text().strip()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] == master:
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, IndexError):
                continue
    try:
        out, err = watch.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        watch.kill()
        out, err = watch.communicate()
    s.outputs.append(out + err)
    return 0, int(watch.returncode != 0), f"watch exit {watch.returncode}"


def override_200k(s: Suite) -> Outcome:
    s.reset(run={**ct200_target(s.hosts, s.workdir)["run"], "overrides": ["--x=" + "a" * 200_000]})
    res = s.fab("train", "--no-warm")
    return 0, int(res.returncode != 2 or "overrides are" not in res.stderr), "inventory: the size, named"


def corrupt_state_files(s: Suite) -> Outcome:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": SHORT_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy", "train", "--no-warm")
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    s.wait(lambda: s.status().get("state") in FINAL, 40)
    wrong = 0
    for name, junk in [
        ("run.json", "{not json"),
        ("exit_code", "x\x7fy"),
        ("pgid", "-1 1"),
        ("attempts.jsonl", "[[["),
        ("events.jsonl", "\x00\x01garbage\n{"),
        ("pid", "1 2 3\n"),
        ("config.json", "[]"),
    ]:
        s.hosts.ct_path(f"{run_dir}/{name}").write_bytes(junk.encode())  # NUL bytes cannot go in an argv
        for args in (("status", "--json"), ("runs",), ("logs",)):
            res = s.fab(*args)
            wrong += int(res.returncode not in (0, 1, 5, 10, 11, 12, 13))
    s.ct("sh", "-c", 'rm -f "$1" && printf junk > "$1"', "x", f"{s.workdir}/runs/latest")
    again = s.fab("train", "--no-warm")  # over a junk runs/latest: a new run, or one clear refusal
    wrong += int(again.returncode not in (0, 2, 5))
    return int(not s.runs()), wrong, "7 files x status/runs/logs; runs/latest junk, then train", 8


def hostile_override(s: Suite) -> Outcome:
    pwn = f"/tmp/{s.label}-pwned"
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": [*SHORT_RUN, f"--x=$(touch {pwn})", f"--y=`touch {pwn}`; touch {pwn}"],
        }
    )
    s.fab("deploy", "train", "--no-warm")
    s.wait(lambda: s.status().get("state") in FINAL, 40)
    injected = s.ct("test", "-e", pwn).returncode == 0
    return 0, int(injected), "no shell ran the override"


def container_stopped(s: Suite) -> Outcome:
    s.reset(container={"type": "pct", "id": s.hosts.stopped_ct_id})
    res = s.fab("status")
    line = res.stderr.strip()
    ok = res.returncode == 3 and str(s.hosts.stopped_ct_id) in line and len(line.splitlines()) == 1
    return 0, int(not ok), "one line naming the container"


def parallel_trains(s: Suite) -> Outcome:
    s.reset()
    s.fab("deploy")
    codes = [code for code, _ in s.fab_at_once("train", "--no-warm")]
    time.sleep(1)
    live = [r for r in s.runs() if s.trainers(f"{s.workdir}/runs/{r}")]
    wrong = int(sorted(codes) != [0, 5, 5] or len(live) != 1)
    s.stop_all()
    return 0, wrong, f"exits {sorted(codes)}, {len(live)} live"


# ------------------------------------------------------------------ the real trainer: tiny-cpu, env local-cpu

TINY_STEPS = 40
TINY = {
    "module": "training",
    "config": "tiny-cpu",
    "overrides": [
        f"--train.steps={TINY_STEPS}",
        "--checkpoint.every=4",
        "--checkpoint.keep=3",
        "--train.log_every=1",
        "--eval.num_prompts=0",
        "--data.corpus_files=60",
    ],
}
UV_CACHE = "/workspace/.fleet-test-uv-cache"  # the e2e tests' cache: torch is large
RESUMED = re.compile(r"run (\S+) resumed at step (\d+) from checkpoint (\S+)")


def tiny(s: Suite, *extra: str, **run: Any) -> None:
    overrides = [*TINY["overrides"], *extra]
    s.reset(
        env="local-cpu",
        uv_cache=UV_CACHE,
        run={**TINY, "overrides": overrides, "env": {"FLEET_FAULT_SECRET": s.secret}, **run},
    )


def events(s: Suite, run_dir: str) -> list[dict[str, Any]]:
    path = s.hosts.ct_path(f"{run_dir}/events.jsonl")
    out = []
    for line in (path.read_text(errors="replace") if path.exists() else "").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def last_step(s: Suite, run_dir: str) -> int:
    steps = [e.get("step", 0) for e in events(s, run_dir) if e.get("event") == "step"]
    return steps[-1] if steps else 0


def saved_steps(s: Suite, run_dir: str) -> list[int]:
    return sorted(int(p.name[5:13]) for p in s.hosts.ct_path(f"{run_dir}/checkpoints").glob("step-*.pt"))


def final_state(s: Suite, timeout: float) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def done() -> bool:
        holder["st"] = s.status()
        return holder["st"].get("state") in FINAL and holder["st"].get("alive") is False

    s.wait(done, timeout)
    return holder.get("st", {})


def start_tiny(s: Suite, at: int) -> str:
    """Deploy + train the tiny run, wait for step ``at``; its run dir ("" when it never got there)."""
    s.fab("deploy", "train", "--no-warm", timeout=1800)
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    alive = s.wait(lambda: last_step(s, run_dir) >= at or s.status().get("alive") is False, 1200)
    return run_dir if alive and last_step(s, run_dir) >= at else ""


def damaged_checkpoints(s: Suite) -> Outcome:
    tiny(s)
    run_dir = start_tiny(s, 9)
    if not run_dir:
        return 0, 1, "the run never reached step 9"
    lost = wrong = 0
    notes = []
    for at, damage, reason in ((9, "overwrite", "sha256 mismatch"), (18, "truncate", "truncated")):
        if not s.wait(lambda at=at: last_step(s, run_dir) >= at, 1200):
            return lost, wrong + 1, f"never reached step {at}"
        if s.fab("stop").returncode == 5:
            final_state(s, 120)
        saved = saved_steps(s, run_dir)
        if len(saved) < 2:
            return 0, 1, f"checkpoints {saved}"
        bad, previous = saved[-1], saved[-2]
        newest = f"{run_dir}/checkpoints/step-{bad:08d}.pt"
        size = s.hosts.ct_path(newest).stat().st_size
        if damage == "overwrite":
            s.ct(
                "dd",
                "if=/dev/urandom",
                f"of={newest}",
                "bs=4096",
                "count=1",
                f"seek={size // 8192}",
                "conv=notrunc",
            )
        else:
            s.ct("truncate", "-s", str(size // 2), newest)
        res = s.fab("train", "--no-warm", timeout=600)
        named = [
            ln
            for ln in res.stdout.splitlines()
            if f"checkpoint step {bad} (" in ln and "failed its check" in ln
        ]
        m = RESUMED.search(res.stdout)
        wrong += int(res.returncode != 0 or len(named) != 1 or reason not in "".join(named))
        wrong += int(not m or int(m.group(2)) != previous + 1)
        aside = s.hosts.ct_path(f"{newest}.bad")
        lost += int(not s.wait(aside.exists, 600))
        lost += int(not s.hosts.ct_path(f"{run_dir}/checkpoints/step-{previous:08d}.pt").exists())
        notes.append(f"{damage}: step {bad} set aside, resumed at {m.group(2) if m else '?'}")
    st = final_state(s, 1500)
    wrong += int(st.get("state") != "finished" or st.get("step") != TINY_STEPS)
    lost += int(len(list(s.hosts.ct_path(f"{run_dir}/checkpoints").glob("*.pt.bad"))) != 2)
    return lost, wrong, "; ".join(notes) + f"; {st.get('state')} at {st.get('step')}", 2


def nan_loss_with_restarts(s: Suite) -> Outcome:
    tiny(
        s,
        "--checkpoint.every=1",
        "--train.lr=1e12",
        "--train.warmup_steps=1",
        restart={"max": 2, "backoff_s": 1},
    )
    s.fab("deploy", "train", "--no-warm", timeout=1800)
    st = final_state(s, 1500)
    run_dir = f"{s.workdir}/runs/{st.get('run_id', s.latest())}"
    diag = (st.get("diagnosis") or [{}])[0]
    m = re.search(r"at step (\d+)", str(diag.get("cause", "")))
    wrong = int(st.get("state") != "failed" or st.get("attempt") != 1)
    wrong += int(st.get("last_cause") != "non-finite-loss (not retryable)" or not m)
    bad = int(m.group(1)) if m else 0
    lost = int(saved_steps(s, run_dir) != list(range(1, bad)))
    return lost, wrong, f"failed at step {bad}, attempt {st.get('attempt')}, checkpoints 1..{bad - 1} kept"


def kill_mid_checkpoint(s: Suite) -> Outcome:
    tiny(s, "--checkpoint.every=1")
    run_dir = start_tiny(s, 4)
    if not run_dir:
        return 0, 1, "the run never reached step 4"
    folder = s.hosts.ct_path(f"{run_dir}/checkpoints")
    caught = s.wait(lambda: any(p.name.endswith(".tmp") for p in folder.iterdir()), 120)
    pgid = s.ct("cat", f"{run_dir}/pgid").stdout.strip()
    s.ct("kill", "-s", "KILL", "--", f"-{pgid}")
    st = final_state(s, 60)
    wrong = int(st.get("state") != "failed")
    kept = saved_steps(s, run_dir)
    res = s.fab("train", "--no-warm", timeout=600)
    m = RESUMED.search(res.stdout)
    wrong += int(res.returncode != 0 or not m or not kept or int(m.group(2)) != kept[-1] + 1)
    s.wait(lambda: last_step(s, run_dir) > (kept[-1] if kept else 0) + 1, 900)
    left = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    wrong += int(
        bool(left) and not s.wait(lambda: not any(p.name.endswith(".tmp") for p in folder.iterdir()), 60)
    )
    return (
        int(not kept),
        wrong,
        f"{'mid-write' if caught else 'between writes'}; resumed at {m.group(2) if m else '?'}",
    )


# ------------------------------------------------------------------ disks, SSH, hostile workdirs


def tmpfs(s: Suite, path: str, size: str) -> None:
    s.ct("mkdir", "-p", path)
    s.ct("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path)


def untmpfs(s: Suite, path: str) -> None:
    s.ct("umount", "-l", path)


def fleet_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    """fab's error lines (``fleet: ...``): a fault must be told in exactly one."""
    return [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("fleet: ")]


def disk_full(res: subprocess.CompletedProcess[str]) -> int:
    """1 unless fab failed with one line naming the full disk."""
    lines = fleet_lines(res)
    return int(res.returncode == 0 or len(lines) != 1 or "no space left" not in lines[0].lower())


def disk_full_at_deploy(s: Suite) -> Outcome:
    full = f"{s.workdir}-full"
    tmpfs(s, full, "64k")
    try:
        s.reset()
        s.target["workdir"] = full
        s.config.write_text(render_inventory({"ct200": s.target}, "ct200"))
        res = s.fab("deploy")
        half = s.ct("test", "-e", f"{full}/current").returncode == 0  # a torn release made current
    finally:
        untmpfs(s, full)
        s.ct("rm", "-rf", "--", full)
        s.reset()
    return int(half), disk_full(res), f"exit {res.returncode}, nothing made current"


def disk_full_at_launch(s: Suite) -> Outcome:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": SHORT_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy")
    runs = f"{s.workdir}/runs"
    tmpfs(s, runs, "8k")
    s.ct("sh", "-c", 'dd if=/dev/zero of="$1/.fill" bs=1k count=64 2>/dev/null; true', "x", runs)
    try:
        res = s.fab("train", "--no-warm")
        wrong = disk_full(res)
        left = s.runs()
    finally:
        untmpfs(s, runs)
    return 0, wrong + int(bool(left)), f"exit {res.returncode}, run dirs left {len(left)}"


def disk_full_at_env_build(s: Suite) -> Outcome:
    s.reset(env="smoke")
    envs = f"{s.workdir}/envs"
    tmpfs(s, envs, "200k")
    try:
        res = s.fab("deploy", timeout=600)
        line = (fleet_lines(res) or [""])[-1]
        wrong = disk_full(res)
        current = s.ct("test", "-e", f"{envs}/smoke/current").returncode == 0
    finally:
        untmpfs(s, envs)
        s.reset()
    return int(current), wrong, f"exit {res.returncode}, no env made current: {line[:70]}"


def parallel_first_deploys(s: Suite) -> Outcome:
    s.reset(env="smoke")
    done = s.fab_at_once("deploy", timeout=900)
    codes = [code for code, _ in done]
    builds = sum(out.count("building env smoke-") for _, out in done)
    on_disk = [n for n in s.ct("ls", "--", f"{s.workdir}/envs").stdout.split() if n.startswith("smoke-")]
    s.reset()
    return 0, int(codes != [0, 0, 0] or builds != 1 or len(on_disk) != 1), f"exits {codes}, {builds} build(s)"


def sshd_down(s: Suite) -> Outcome:
    s.reset()
    s.target["host"] = f"{s.hosts.ssh_user}@127.0.0.1:1"  # nothing listens there: sshd down
    s.config.write_text(render_inventory({"ct200": s.target}, "ct200"))
    res = s.fab("status")
    lines = fleet_lines(res)
    ok = res.returncode == 3 and len(lines) == 1 and "127.0.0.1" in lines[0]
    s.reset()
    return 0, int(not ok), (lines or [res.stderr.strip()])[0][:100]


def hostile_workdir(s: Suite) -> Outcome:
    pwn = f"/tmp/{s.label}-pwned-wd"
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": SHORT_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.target["workdir"] = f"{s.workdir}/a b;$(touch {pwn})`touch {pwn}`'\""
    s.config.write_text(render_inventory({"ct200": s.target}, "ct200"))
    s.fab("deploy", "train", "--no-warm")
    st = final_state(s, 60)
    injected = s.ct("test", "-e", pwn).returncode == 0
    s.reset()
    return 0, int(injected) + int(st.get("state") != "finished"), f"no shell ran it; run {st.get('state')}"


def host_unreachable_under_run(s: Suite) -> Outcome:
    """The controller loses the host (sshd down as seen from here) while a run trains, then finds it again."""
    s.reset()
    s.fab("deploy", "train", "--no-warm")
    run_id = s.latest()
    run_dir = f"{s.workdir}/runs/{run_id}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    reachable = s.config.read_text()
    s.target["host"] = f"{s.hosts.ssh_user}@127.0.0.1:1"  # nothing listens there
    s.config.write_text(render_inventory({"ct200": s.target}, "ct200"))
    answers = [s.fab("status"), s.fab("stop"), s.fab("train", "--no-warm")]
    wrong = sum(int(r.returncode != 3 or len(fleet_lines(r)) != 1) for r in answers)
    trained_on = bool(s.trainers(run_dir))
    s.config.write_text(reachable)
    st = s.status()
    wrong += int(not trained_on or st.get("state") != "training" or st.get("run_id") != run_id)
    lost = int(run_id not in s.runs())
    return lost, wrong, f"status/stop/train: one line each, exit 3; the run trained on ({st.get('state')})"


def parallel_stops(s: Suite) -> Outcome:
    s.reset()
    s.fab("deploy", "train", "--no-warm")
    run_id = s.latest()
    run_dir = f"{s.workdir}/runs/{run_id}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    codes = [code for code, _ in s.fab_at_once("stop")]
    st = final_state(s, 60)
    wrong = int(codes != [0, 0, 0] or st.get("state") != "stopped" or bool(s.trainers(run_dir)))
    return int(run_id not in s.runs()), wrong, f"exits {codes}, run {st.get('state')}"


def disk_full_at_checkpoint(s: Suite) -> Outcome:
    """runs/ on a tmpfs; once checkpoints exist, a filler leaves less than one checkpoint free.
    The tmpfs is the container's own mount: read through `pct exec`, not the host's rootfs path."""
    runs = f"{s.workdir}/runs"

    def ct_steps(run_dir: str) -> list[int]:
        out = s.ct("sh", "-c", 'tail -c 65536 -- "$1/events.jsonl" 2>/dev/null', "x", run_dir).stdout
        return [int(m) for m in re.findall(r'"event": ?"step".*?"step": ?(\d+)', out)]

    def ct_saved(run_dir: str) -> dict[int, int]:
        listing = 'stat -c "%n %s" -- "$1"/checkpoints/step-*.pt 2>/dev/null'
        out = s.ct("sh", "-c", listing, "x", run_dir).stdout
        found = re.findall(r"step-(\d{8})\.pt (\d+)", out)
        return {int(step): int(size) for step, size in found}

    tiny(s, "--checkpoint.every=1", "--train.steps=100000")  # still training when the disk fills
    s.fab("deploy", timeout=1800)
    tmpfs(s, runs, "96m")
    try:
        s.fab("train", "--no-warm", timeout=1800)
        run_dir = f"{runs}/{s.latest()}"
        if not s.wait(lambda: len(ct_saved(run_dir)) >= 2 or s.status().get("alive") is False, 1200):
            return 0, 1, "no two checkpoints in 1200 s"
        saved = ct_saved(run_dir)
        if len(saved) < 2:
            return 0, 1, f"the run ended with checkpoints {sorted(saved)}: {s.status().get('state')}"
        filler = f"{runs}/.filler"
        for _ in range(10):
            # A checkpoint written between the df and the fallocate makes the filler too big to
            # fit, and the disk never fills: measure again and retry.
            free = s.ct("df", "-B1", "--output=avail", runs).stdout.split()[-1]
            size = str(max(int(free) - max(saved.values()) // 2, 0))
            if s.ct("fallocate", "-l", size, filler).returncode == 0:
                break
            s.ct("rm", "-f", "--", filler)
        st = final_state(s, 600)
        diag = " ".join(str(d.get("cause", "")) for d in st.get("diagnosis") or [])
        wrong = int(st.get("state") != "failed" or "no space left" not in diag.lower())
        kept = sorted(ct_saved(run_dir))
        s.ct("rm", "-f", "--", filler)
        res = s.fab("train", "--no-warm", timeout=600)
        m = RESUMED.search(res.stdout)
        wrong += int(res.returncode != 0 or not m or not kept or int(m.group(2)) != kept[-1] + 1)
        s.wait(lambda: bool(ct_steps(run_dir)) and ct_steps(run_dir)[-1] > (kept[-1] if kept else 0), 600)
        resumed = m.group(2) if m else "?"
        return int(not kept), wrong, f"failed: {diag[:60]}; kept {kept[-3:]}; resumed at {resumed}"
    finally:
        s.stop_all()
        untmpfs(s, runs)


# ------------------------------------------------------------ state files, kill -9 of fab, races, SSH, inputs

STATE_CODES = (0, 10, 11, 12, 13)  # `fab status`'s answers about a run, not errors


def untold(res: subprocess.CompletedProcess[str]) -> int:
    """1 when fab failed without exactly one ``fleet:`` line saying why."""
    return int(res.returncode not in STATE_CODES and len(fleet_lines(res)) != 1)


def short(s: Suite, *overrides: str, env: dict[str, str] | None = None, **changes: Any) -> None:
    """The selftest run of a few steps, carrying the secret (plus ``env``)."""
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": [*SHORT_RUN, *overrides],
            "env": {"FLEET_FAULT_SECRET": s.secret, **(env or {})},
        },
        **changes,
    )


def long_run(s: Suite, env: dict[str, str] | None = None, **changes: Any) -> None:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": LONG_RUN,
            "env": {"FLEET_FAULT_SECRET": s.secret, **(env or {})},
        },
        **changes,
    )


def listing(s: Suite, path: str) -> list[str]:
    """A container directory's entries, read on the host's side of its rootfs (fast to poll)."""
    folder = s.hosts.ct_path(path)
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def kill_fab_when(s: Suite, args: tuple[str, ...], ready: Callable[[], bool], timeout: float = 300) -> bool:
    """`fab ARGS`, killed with SIGKILL as soon as ``ready()``; whether it was still running then."""
    proc = s.fab_popen(*args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.005)
    running = proc.poll() is None
    proc.kill()
    out, err = proc.communicate()
    s.outputs.append(out + err)
    return running


def env_works(s: Suite) -> bool:
    """The smoke env's `current` build runs its python and imports its packages."""
    python = f"{s.workdir}/envs/smoke/current/bin/python"
    return s.ct(python, "-c", "import six, idna").returncode == 0


def smoke_builds(s: Suite) -> list[str]:
    return [n for n in listing(s, f"{s.workdir}/envs") if n.startswith("smoke-")]


def corrupt_env_state(s: Suite) -> Outcome:
    """The env's state files damaged one at a time; after each, env-check/status/deploy answer in
    one line (or not at all) and either deploy or `fab env-rebuild` gives a working env again."""
    s.reset(env="smoke")
    if s.fab("deploy", timeout=600).returncode != 0 or not env_works(s):
        return 0, 1, "the first deploy did not build the env"
    envs = f"{s.workdir}/envs"
    good = s.ct("readlink", "--", f"{envs}/smoke/current").stdout.strip()
    manifest = f"{envs}/smoke/current/fleet-env/manifest.json"
    s.ct("cp", "--", manifest, f"{manifest}.orig")
    junk_file = 'rm -f "$1" && printf "junk\\n\\001" > "$1"'
    # Each damage, and what env-check's line must name when it refuses ("" = it may not refuse).
    cases: list[tuple[str, tuple[str, ...], str]] = [
        (
            "envs/smoke/current dangles",
            ("ln", "-sfn", "../smoke-0000000000000000", f"{envs}/smoke/current"),
            "smoke/current",
        ),
        (
            "envs/smoke/current is a junk file",
            ("sh", "-c", junk_file, "x", f"{envs}/smoke/current"),
            "smoke/current",
        ),
        ("the build lock holds junk", ("sh", "-c", junk_file, "x", f"{envs}/.build-smoke.lock"), ""),
        ("the build's manifest.json is junk", ("sh", "-c", junk_file, "x", manifest), "manifest"),
    ]
    wrong = 0
    notes = []
    for name, damage, cause in cases:
        s.ct(*damage)
        answers = [s.fab("env-check"), s.fab("status", "--json"), s.fab("deploy", timeout=600)]
        wrong += sum(untold(r) for r in answers)
        said = " ".join(fleet_lines(answers[0]))
        wrong += int(
            answers[0].returncode != 0 and (not cause or cause not in said or "does not run" in said)
        )
        fixed = "deploy"
        if answers[-1].returncode != 0 or not env_works(s) or s.fab("env-check").returncode != 0:
            fixed = "env-rebuild"
            rebuild = s.fab("env-rebuild", timeout=600)
            wrong += untold(rebuild) + int(rebuild.returncode != 0 or not env_works(s))
        notes.append(f"{name}: env-check {answers[0].returncode}, deploy {answers[-1].returncode}, {fixed}")
        s.ct("rm", "-f", "--", f"{envs}/smoke/current")
        s.ct("ln", "-sfn", good, f"{envs}/smoke/current")
        s.ct("cp", "--", f"{manifest}.orig", manifest)
    s.reset()
    return 0, wrong, "; ".join(notes), len(cases)


def release_current_dangles(s: Suite) -> Outcome:
    short(s)
    s.fab("deploy")
    old = s.ct("readlink", "--", f"{s.workdir}/current").stdout.strip()
    s.ct("ln", "-sfn", "releases/29990101T000000Z-gone", f"{s.workdir}/current")
    answers = [s.fab("status", "--json"), s.fab("train", "--no-warm")]
    wrong = sum(untold(r) for r in answers)
    started = answers[-1].returncode == 0
    if started:
        final_state(s, 40)
    deploy = s.fab("deploy")
    train = s.fab("train", "--no-warm")
    st = final_state(s, 40)
    wrong += int(deploy.returncode != 0 or train.returncode != 0 or st.get("state") != "finished")
    lost = int(s.ct("test", "-e", f"{s.workdir}/{old}/MANIFEST.json").returncode != 0)
    return (
        lost,
        wrong,
        f"status {answers[0].returncode}, train {answers[1].returncode}; deploy + train then ran",
    )


def inventory_bad_toml(s: Suite) -> Outcome:
    s.reset()
    s.config.write_text(s.config.read_text() + '\n[targets.ct200.run\nenv = { X = "unclosed }\n')
    res = s.fab("status")
    lines = fleet_lines(res)
    ok = res.returncode == 2 and len(lines) == 1 and "line" in lines[0] and s.config.name in lines[0]
    s.reset()
    return 0, int(not ok), (lines or [res.stderr.strip()])[0][:100]


def corrupt_run_files_more(s: Suite) -> Outcome:
    """Five more run-dir files junk, one at a time in the newest (finished) run; status/runs/logs
    answer, and the next `fab train` starts and finishes."""
    short(s, keep_runs=50)
    s.fab("deploy", "train", "--no-warm")
    first = s.latest()
    wrong = 0
    cases = [
        ("segments.jsonl", b'\x00{][\n{"segment": "x"}\n'),
        ("stop_signal", b"\x00\xff junk\n"),
        ("run.env", b"FLEET_FAULT_X='unterminated\nexport ("),
        ("attempts-earlier.jsonl", b'{"attempt": [}\n\x00'),
        ("checkpoints/step-000006.json", b"{not json"),
    ]
    for name, junk in cases:
        final_state(s, 40)
        run_dir = f"{s.workdir}/runs/{s.latest()}"
        path = s.hosts.ct_path(f"{run_dir}/{name}")
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(junk)
        for args in (("status", "--json"), ("runs",), ("logs",)):
            wrong += untold(s.fab(*args))
        again = s.fab("train", "--no-warm")
        st = final_state(s, 60)
        wrong += untold(again) + int(again.returncode != 0 or st.get("state") != "finished")
    return (
        int(first not in s.runs()),
        wrong,
        "5 files x status/runs/logs, then train ran each time",
        len(cases),
    )


SLOW_PCT = """#!{python}
import os, subprocess, sys, time
real = {real!r}
if "fleet-put-tar" in sys.argv:
    # The first 32 KiB of the release arrive, then the link stalls (fab is killed meanwhile) and
    # the rest never does: the remote end sees its stdin end early.
    proc = subprocess.Popen([real, *sys.argv[1:]], stdin=subprocess.PIPE)
    proc.stdin.write(sys.stdin.buffer.read(32768))
    proc.stdin.flush()
    open({marker!r}, "w").close()
    time.sleep(3)
    while sys.stdin.buffer.read(65536):
        pass
    proc.stdin.close()
    sys.exit(proc.wait())
os.execv(real, [real, *sys.argv[1:]])
"""


def kill_deploy_mid_upload(s: Suite) -> Outcome:
    short(s)
    s.fab("deploy")
    old = s.ct("readlink", "--", f"{s.workdir}/current").stdout.strip()
    slow, marker = s.tmp / "slow-pct", s.tmp / "upload-started"
    slow.write_text(SLOW_PCT.format(python=sys.executable, real=s.hosts.pct, marker=str(marker)))
    slow.chmod(0o755)
    commands = {**ct200_target(s.hosts, s.workdir)["commands"], "tmux": s.tmux, "pct": str(slow)}
    short(s, commands=commands)
    time.sleep(1.1)  # release ids are per second
    caught = kill_fab_when(s, ("deploy",), marker.exists)
    s.wait(lambda: not processes_naming(str(slow)), 60)
    s.wait(lambda: not [n for n in listing(s, f"{s.workdir}/releases") if n.startswith(".tmp")], 30)
    kept = s.ct("readlink", "--", f"{s.workdir}/current").stdout.strip() == old
    whole = s.ct("test", "-f", f"{s.workdir}/current/MANIFEST.json").returncode == 0
    short(s)
    again = s.fab("deploy")
    train = s.fab("train", "--no-warm")
    st = final_state(s, 40)
    wrong = int(not caught) + int(
        again.returncode != 0 or train.returncode != 0 or st.get("state") != "finished"
    )
    left = [n for n in listing(s, f"{s.workdir}/releases") if n.startswith(".tmp")]
    wrong += int(bool(left))
    return (
        int(not (kept and whole)),
        wrong,
        f"old release kept {kept}; next deploy {again.returncode}, run {st.get('state')}",
    )


def kill_first_env_build(s: Suite) -> Outcome:
    s.reset(env="smoke")
    s.ct("rm", "-rf", "--", f"{s.workdir}/envs")
    caught = kill_fab_when(s, ("deploy",), lambda: bool(smoke_builds(s)), 600)
    time.sleep(2)
    again = s.fab("deploy", timeout=600)
    check = s.fab("env-check")
    wrong = (
        int(not caught)
        + untold(again)
        + int(again.returncode != 0 or check.returncode != 0 or not env_works(s))
    )
    s.reset()
    return (
        0,
        wrong,
        f"killed {'mid-build' if caught else 'late'}; deploy {again.returncode}, check {check.returncode}",
    )


def kill_env_rebuild(s: Suite) -> Outcome:
    s.reset(env="smoke")
    s.fab("deploy", timeout=600)
    envs = f"{s.workdir}/envs"
    before = s.ct("readlink", "--", f"{envs}/smoke/current").stdout.strip()
    builds = set(smoke_builds(s))
    caught = kill_fab_when(s, ("env-rebuild",), lambda: bool(set(smoke_builds(s)) - builds), 600)
    time.sleep(2)
    now = s.ct("readlink", "--", f"{envs}/smoke/current").stdout.strip()
    kept = env_works(s) and now in (before, *[f"../{b}" for b in smoke_builds(s)])
    wrong = int(not caught) + int(now != before and not env_works(s))
    rebuild = s.fab("env-rebuild", timeout=600)
    check = s.fab("env-check")
    wrong += untold(rebuild) + int(rebuild.returncode != 0 or check.returncode != 0 or not env_works(s))
    s.reset()
    return (
        int(not kept),
        wrong,
        f"current {'kept' if now == before else 'moved'}; next rebuild {rebuild.returncode}",
    )


def parallel_env_rebuilds(s: Suite) -> Outcome:
    s.reset(env="smoke")
    s.fab("deploy", timeout=600)
    done = s.fab_at_once("env-rebuild", timeout=900)
    codes = [code for code, _ in done]
    told = sum(
        int(code != 0 and len([ln for ln in out.splitlines() if ln.startswith("fleet: ")]) != 1)
        for code, out in done
    )
    check = s.fab("env-check")
    wrong = told + int(0 not in codes or check.returncode != 0 or not env_works(s))
    s.reset()
    return 0, wrong, f"exits {codes}, env-check {check.returncode}"


def kill_train_mid_launch(s: Suite) -> Outcome:
    long_run(s)
    s.fab("deploy")
    caught = kill_fab_when(s, ("train", "--no-warm"), lambda: bool(s.runs()), 120)
    time.sleep(3)
    live = [r for r in s.runs() if s.trainers(f"{s.workdir}/runs/{r}")]
    dead = [r for r in s.runs() if r not in live]
    again = s.fab("train", "--no-warm")
    time.sleep(1)
    after = [r for r in s.runs() if s.trainers(f"{s.workdir}/runs/{r}")]
    trainers = sum(len(s.trainers(f"{s.workdir}/runs/{r}")) for r in s.runs())
    wrong = int(not caught) + untold(again) + int(bool(dead) or trainers != 1 or len(after) != 1)
    wrong += int(again.returncode != (5 if live else 0))
    return 0, wrong, f"left {len(live)} live, {len(dead)} dead run dir(s); next train {again.returncode}"


def deploy_under_live_run(s: Suite) -> Outcome:
    long_run(s, keep_releases=2)
    s.fab("deploy", "train", "--no-warm")
    run_id = s.latest()
    run_dir = f"{s.workdir}/runs/{run_id}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    pids = s.trainers(run_dir)
    cwd = os.readlink(f"/proc/{pids[0]}/cwd") if pids else ""
    codes = []
    for _ in range(3):  # past keep_releases: pruning must spare the live run's release
        time.sleep(1.1)
        codes.append(s.fab("deploy").returncode)
    still = s.trainers(run_dir)
    # /proc/PID/cwd reads as the container sees it: the release is checked in there.
    same = bool(still) and os.readlink(f"/proc/{still[0]}/cwd") == cwd
    same = same and "/releases/" in cwd and s.ct("test", "-f", f"{cwd}/MANIFEST.json").returncode == 0
    st = s.status()
    wrong = int(codes != [0, 0, 0] or not same or st.get("state") != "training" or st.get("run_id") != run_id)
    return int(run_id not in s.runs()), wrong, f"deploys {codes}; the run kept its release: {same}"


def stop_and_train_at_once(s: Suite) -> Outcome:
    long_run(s, keep_runs=50)
    s.fab("deploy", "train", "--no-warm")
    run_id = s.latest()
    s.wait(lambda: bool(s.trainers(f"{s.workdir}/runs/{run_id}")))
    procs = {args[0]: s.fab_popen(*args) for args in (("stop",), ("train", "--no-warm"))}
    codes = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        s.outputs.append(out + err)
        codes[name] = proc.returncode
        if (
            proc.returncode != 0
            and len([ln for ln in (out + err).splitlines() if ln.startswith("fleet: ")]) != 1
        ):
            codes[name] = -1  # failed without one line
    time.sleep(2)
    trainers = sum(len(s.trainers(f"{s.workdir}/runs/{r}")) for r in s.runs())
    wrong = int(codes["stop"] != 0 or codes["train"] not in (0, 5) or trainers != int(codes["train"] == 0))
    return (
        int(run_id not in s.runs()),
        wrong,
        f"stop {codes['stop']}, train {codes['train']}, {trainers} trainer(s) after",
    )


def stop_mid_checkpoint_write(s: Suite) -> Outcome:
    """SIGTERM (`fab stop`) while the selftest writes a 300 MB checkpoint: the write completes, the run
    checkpoints and ends `stopped`, no half file."""
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": [
                "--selftest.steps=100000",
                "--selftest.step_seconds=0.2",
                "--selftest.checkpoint_every=5",
                f"--selftest.checkpoint_bytes={300 * 2**20}",
            ],
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy", "train", "--no-warm")
    folder = f"{s.workdir}/runs/{s.latest()}/checkpoints"
    caught = s.wait(lambda: any(n.endswith(".tmp") for n in listing(s, folder)), 60)
    stop = s.fab("stop")
    st = final_state(s, 60)
    names = listing(s, folder)
    whole = 0
    for name in names:
        with s.hosts.ct_path(f"{folder}/{name}").open("rb") as fh:
            whole += int(name.endswith(".json") and json.loads(fh.readline()).get("step") is not None)
    wrong = int(
        stop.returncode != 0 or st.get("state") != "stopped" or any(n.endswith(".tmp") for n in names)
    )
    return (
        int(not whole),
        wrong,
        f"{'mid-write' if caught else 'between writes'}; {st.get('state')}, {whole} whole",
    )


def ssh_fault(s: Suite, what: str, expect: str, **changes: Any) -> Outcome:
    """`fab deploy` against a target the fault makes unusable: exit 3, one line naming ``expect``,
    nothing changed in the workdir."""
    s.reset(**changes)
    before = listing(s, f"{s.workdir}/releases")
    res = s.fab("deploy")
    lines = fleet_lines(res)
    ok = res.returncode == 3 and len(lines) == 1 and expect.lower() in lines[0].lower()
    changed = listing(s, f"{s.workdir}/releases") != before
    s.reset()
    return 0, int(not ok) + int(changed), (lines or [res.stderr.strip() or "no line"])[0][:110]


def host_key_changed(s: Suite) -> Outcome:
    return ssh_fault(s, "host key", "host key", known_hosts=s.hosts.known_hosts_wrong)


def wrong_user(s: Suite) -> Outcome:
    rest = s.hosts.host.partition("@")[2]
    return ssh_fault(s, "user", "nobody-here", host=f"nobody-here@{rest}")


def unknown_key(s: Suite) -> Outcome:
    other = str(Path(s.hosts.identity).parent / "other_host_key")
    return ssh_fault(s, "key", "identity_file", identity_file=other)


def no_such_container(s: Suite) -> Outcome:
    return ssh_fault(s, "container", "999", container={"type": "pct", "id": 999})


def hostile_env_value(s: Suite) -> Outcome:
    pwn = f"/tmp/{s.label}-pwned-env"
    value = f"q'u\"o\\te\nline 2 $(touch {pwn}) `touch {pwn}`; touch {pwn} ${{IFS}} {s.secret}"
    long_run(s, env={"FLEET_FAULT_HOSTILE": value})
    s.fab("deploy", "train", "--no-warm")
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    s.wait(lambda: bool(s.trainers(run_dir)))
    pids = s.trainers(run_dir)
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0") if pids else []
    verbatim = f"FLEET_FAULT_HOSTILE={value}".encode() in environ
    injected = s.ct("test", "-e", pwn).returncode == 0
    s.stop_all()
    return 0, int(not verbatim) + int(injected), f"verbatim in the trainer's env: {verbatim}; no shell ran it"


def bad_env_name(s: Suite) -> Outcome:
    short(s, env={"BAD-NAME": "x"})
    res = s.fab("train", "--no-warm")
    lines = fleet_lines(res)
    ok = res.returncode == 2 and len(lines) == 1 and "BAD-NAME" in lines[0]
    return 0, int(not ok), (lines or [res.stderr.strip()])[0][:100]


def override_with_newline(s: Suite) -> Outcome:
    pwn = f"/tmp/{s.label}-pwned-nl"
    hostile = f"--x=a\nb; touch {pwn}\n$(touch {pwn})"
    short(s, hostile)
    res = s.fab("deploy", "train", "--no-warm")
    st = final_state(s, 40)
    log = s.hosts.ct_path(f"{s.workdir}/runs/{s.latest()}/train.log")
    seen = log.exists() and f"ignoring override {hostile}" in log.read_text(errors="replace")
    injected = s.ct("test", "-e", pwn).returncode == 0
    wrong = (
        untold(res) + int(injected) + int(res.returncode == 0 and (st.get("state") != "finished" or not seen))
    )
    return 0, wrong, f"exit {res.returncode}, run {st.get('state')}, reached verbatim: {seen}"


def notify_command_metachars(s: Suite) -> Outcome:
    pwn, out = f"/tmp/{s.label}-pwned-notify", f"/tmp/{s.label}-notify-out"
    meta = f"$(touch {pwn}); `touch {pwn}` | touch {pwn} & > {pwn}"
    write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    short(s, notify={"command": ["python3", "-c", write, out, meta]})
    s.fab("deploy", "train", "--no-warm")
    st = final_state(s, 40)
    path = s.hosts.ct_path(out)
    s.wait(path.exists, 30)
    verbatim = path.exists() and path.read_text() == meta
    injected = s.ct("test", "-e", pwn).returncode == 0
    s.ct("rm", "-f", "--", out)
    return (
        0,
        int(not verbatim) + int(injected) + int(st.get("state") != "finished"),
        f"argv verbatim: {verbatim}",
    )


def stop_in_eval(s: Suite) -> Outcome:
    """`fab stop` (SIGTERM) while the real trainer evaluates after its last step: `stopped`, the
    step's checkpoint kept, and the note says a resume starts from it."""
    tiny(
        s,
        "--train.steps=2",
        "--checkpoint.every=0",
        "--eval.num_prompts=8",
        "--eval.max_new_tokens=400",
        "--data.eval_prompts=8",
    )
    s.fab("deploy", "train", "--no-warm", timeout=1800)
    run_dir = f"{s.workdir}/runs/{s.latest()}"
    seen = s.wait(lambda: s.status().get("state") == "evaluating", 1200)
    stop = s.fab("stop", timeout=300)
    st = final_state(s, 300)
    notes = " ".join(st.get("notes") or [])
    kept = saved_steps(s, run_dir)
    wrong = int(not seen or stop.returncode != 0 or st.get("state") != "stopped")
    wrong += int("stopped during eval" not in notes)
    return (
        int(2 not in kept),
        wrong,
        f"{'in the eval' if seen else 'eval not seen'}; {st.get('state')}, kept {kept}",
    )


def stop_in_data_phase(s: Suite) -> Outcome:
    """`fab stop` while the real trainer regenerates its data (no step yet): `stopped`, the run dir
    kept, and the note says a resume starts over (there is no checkpoint to lose)."""
    tiny(s, "--data.regenerate=true", "--data.regen_prompts=600", "--data.regen_batch_size=2")
    s.fab("deploy", "train", "--no-warm", timeout=1800)
    run_id = s.latest()

    def regenerating() -> bool:
        st = s.status()
        return st.get("phase") == "load_data" and bool((st.get("progress") or {}).get("done"))

    seen = s.wait(regenerating, 1200)
    stop = s.fab("stop", timeout=300)
    st = final_state(s, 300)
    notes = " ".join(st.get("notes") or [])
    wrong = int(not seen or stop.returncode != 0 or st.get("state") != "stopped")
    wrong += int("stopped during load_data" not in notes)
    return (
        int(run_id not in s.runs()),
        wrong,
        f"{'mid-regeneration' if seen else 'not seen'}; {st.get('state')}",
    )


SCENARIOS: dict[str, Callable[[Suite], Outcome]] = {
    "notify url with a control character": notify_bad_url,
    "notify header outside latin-1": notify_bad_header,
    "200 KB override": override_200k,
    "container stopped": container_stopped,
    "tmux kill-server under a live run": tmux_dies,
    "connection drops while the launch's env travels": launch_connection_drops,
    "env current repointed under a live run": env_switched_under_run,
    "notify command hangs": notify_hangs,
    "kill -9 of the run's process group": group_kill_9,
    "runs/latest dangles": dangling_latest,
    "SSH sessions dropped under status --watch": watch_ssh_drop,
    "corrupt state files": corrupt_state_files,
    "hostile overrides ($(), backticks, ;)": hostile_override,
    "three parallel `fab train`": parallel_trains,
    "hostile workdir (space, ;, $(), backticks, quotes)": hostile_workdir,
    "sshd down": sshd_down,
    "host unreachable under a live run, then back": host_unreachable_under_run,
    "three parallel `fab stop`": parallel_stops,
    "disk full at deploy (workdir on a 64 KB tmpfs)": disk_full_at_deploy,
    "disk full at launch (runs/ on a full tmpfs)": disk_full_at_launch,
    "disk full at env build (envs/ on a 200 KB tmpfs)": disk_full_at_env_build,
    "three parallel first deploys of an env": parallel_first_deploys,
    "newest checkpoint overwritten (4 KB), later one truncated": damaged_checkpoints,
    "non-finite loss with a restart policy": nan_loss_with_restarts,
    "kill -9 of the trainer mid-checkpoint-write": kill_mid_checkpoint,
    "disk full at a checkpoint write (runs/ on a tmpfs, filled)": disk_full_at_checkpoint,
    "corrupt env state (current dangling / junk, build lock, manifest)": corrupt_env_state,
    "release `current` dangles": release_current_dangles,
    "inventory with invalid TOML": inventory_bad_toml,
    "corrupt run files (segments, stop_signal, run.env, old attempts, checkpoint)": corrupt_run_files_more,
    "kill -9 of `fab deploy` mid-upload": kill_deploy_mid_upload,
    "kill -9 of `fab deploy` mid first env build": kill_first_env_build,
    "kill -9 of `fab env-rebuild` mid-build": kill_env_rebuild,
    "three parallel `fab env-rebuild`": parallel_env_rebuilds,
    "kill -9 of `fab train` mid-launch": kill_train_mid_launch,
    "three `fab deploy` under a live run": deploy_under_live_run,
    "`fab stop` and `fab train` at once": stop_and_train_at_once,
    "SIGTERM mid-checkpoint-write (300 MB)": stop_mid_checkpoint_write,
    "host key changed (known_hosts mismatch)": host_key_changed,
    "wrong SSH user": wrong_user,
    "SSH key not authorized": unknown_key,
    "container id that does not exist": no_such_container,
    "run env value with quotes, newline, $(), backticks": hostile_env_value,
    "run env name invalid": bad_env_name,
    "override with newlines and $()": override_with_newline,
    "notify command with shell metacharacters": notify_command_metachars,
    "SIGTERM (`fab stop`) in the trainer's eval": stop_in_eval,
    "SIGTERM (`fab stop`) in the trainer's data phase (regeneration)": stop_in_data_phase,
}
PENDING: dict[str, str] = {}
# What goes between scenarios: runs/ and every env but the torch one (thousands of files, reused).
BETWEEN_SCENARIOS = (
    "-mindepth",
    "1",
    "-maxdepth",
    "2",
    "(",
    "-path",
    "*/runs",
    "-o",
    "-path",
    "*/envs/*",
    ")",
)
BETWEEN_SCENARIOS += ("!", "-name", "local-cpu*", "-exec", "rm", "-rf", "--", "{}", "+")


def sample_ps(s: Suite, stop: threading.Event) -> None:
    while not stop.is_set():
        out = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True, check=False)
        s.ps_lines.extend(line for line in out.stdout.splitlines() if any(x in line for x in s.secrets))
        time.sleep(0.1)


def secrets_in_files(s: Suite, since: float) -> list[str]:
    root = Path(s.hosts.ct_rootfs)
    hits = []
    for base in (root / "workspace" / s.label, root / "tmp"):
        for dirpath, _, files in os.walk(base):
            for name in files:
                path = Path(dirpath) / name
                try:
                    if path.is_symlink() or path.stat().st_ctime < since:
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue
                hits.extend(f"{path}: {x[:12]}..." for x in s.secrets if x.encode() in data)
    return hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names (substrings)")
    parser.add_argument("--skip", default="", help="comma-separated scenario names (substrings) not to run")
    parser.add_argument("--tmp", default="/tmp")
    args = parser.parse_args()
    hosts = _host_problem()
    if isinstance(hosts, str):
        print(hosts, file=sys.stderr)
        return 1
    tmp = Path(args.tmp) / f"fleet-fault-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    suite = Suite(hosts, tmp)
    stop = threading.Event()
    sampler = threading.Thread(target=sample_ps, args=(suite, stop), daemon=True)
    sampler.start()
    rows: list[Row] = []
    wanted = [w for w in args.only.split(",") if w]
    skipped = [w for w in args.skip.split(",") if w]
    t0 = time.time()
    try:
        for name, scenario in SCENARIOS.items():
            if (wanted and not any(w in name for w in wanted)) or any(w in name for w in skipped):
                continue
            before, ps_before = len(suite.outputs), len(suite.ps_lines)
            started = time.time()
            try:
                lost, wrong, note, *count = scenario(suite)
            except Exception as err:  # a broken scenario is a row, not the end of the suite
                lost, wrong, note, count = 0, 1, f"scenario error: {type(err).__name__}: {err}"[:120], []
            suite.stop_all()
            outs = suite.outputs[before:]
            rows.append(
                Row(
                    name,
                    faults=count[0] if count else 1,
                    lost=lost,
                    wrong=wrong,
                    tracebacks=sum(TRACEBACK in o for o in outs),
                    secrets=sum(any(x in o for x in suite.secrets) for o in outs)
                    + len(suite.ps_lines)
                    - ps_before,
                    note=f"{note} ({time.time() - started:.0f} s)",
                )
            )
            # The torch env (thousands of files) stays for the next trainer scenario; the rest goes.
            suite.ct("find", suite.workdir, *BETWEEN_SCENARIOS)
            r = rows[-1]
            print(
                f"{r.fault}: faults {r.faults}, lost {r.lost}, secrets {r.secrets}, "
                f"tracebacks {r.tracebacks}, wrong {r.wrong}; {r.note}",
                flush=True,
            )
    finally:
        stop.set()
        sampler.join(5)
        file_hits = secrets_in_files(suite, t0)
        print(f"secrets in container files changed by the suite: {len(file_hits)}", flush=True)
        suite.cleanup()
    rows.extend(Row(name, note=why, pending=True) for name, why in PENDING.items())
    print(table(rows, file_hits))
    return 0


def table(rows: list[Row], file_hits: list[str]) -> str:
    done = [r for r in rows if not r.pending]
    lines = [
        "| fault | faults | runs/ckpts lost | secrets seen | tracebacks | wrong cause | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.pending:
            lines.append(f"| {r.fault} | - | - | - | - | - | {r.note} |")
        else:
            lines.append(
                f"| {r.fault} | {r.faults} | {r.lost} | {r.secrets} | {r.tracebacks} | {r.wrong} | {r.note} |"
            )
    tried = sum(r.faults for r in done)
    total = (
        f"| **total: {tried} faults tried** ({len(done)} rows) | **{tried}** | "
        f"**{sum(r.lost for r in done)}** | "
        f"**{sum(r.secrets for r in done) + len(file_hits)}** | **{sum(r.tracebacks for r in done)}** | "
        f"**{sum(r.wrong for r in done)}** | "
        f"secrets in container files changed by the suite: {len(file_hits)} |"
    )
    lines.append(total)
    lines.extend(f"  file hit: {h}" for h in file_hits)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
