"""Fault suite: faults and bad inputs replayed through the real `fab` against the test host (SSH ->
pct shim -> LXC container 200, /bin/sh = dash there) with the selftest run, then one table:

    fault | runs/checkpoints lost | secrets seen | tracebacks shown | wrong cause

    .venv/bin/python benchmarks/fault_suite.py [--only NAME,...] [--markdown]

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


@dataclass
class Row:
    fault: str
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

    def fab(
        self, *args: str, timeout: float = 180, config: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(FLEET_CONFIG=str(config or self.config), PYTHONUNBUFFERED="1")
        res = subprocess.run(
            [str(FAB), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        self.outputs.append(res.stdout + res.stderr)
        return res

    def status(self) -> dict[str, Any]:
        res = self.fab("status", "--json")
        try:
            data = json.loads(res.stdout)
        except json.JSONDecodeError:
            return {"state": "?", "raw": res.stdout + res.stderr}
        return data if isinstance(data, dict) else {"state": "?"}

    def ct(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.hosts.pct_exec(*argv, check=False)

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
        self.ct("rm", "-rf", "--", self.workdir, self.tmux)


# ------------------------------------------------------------------ scenarios (each: lost, wrong, note)


def tmux_dies(s: Suite) -> tuple[int, int, str]:
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


def launch_connection_drops(s: Suite) -> tuple[int, int, str]:
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


def env_switched_under_run(s: Suite) -> tuple[int, int, str]:
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


def notify_bad_url(s: Suite) -> tuple[int, int, str]:
    s.reset(notify={"url": f"https://hooks.example/{s.url_token}\x01"})
    res = s.fab("status")
    return (
        0,
        int(res.returncode != 2 or "notify.url" not in res.stderr),
        "inventory: one line naming notify.url",
    )


def notify_bad_header(s: Suite) -> tuple[int, int, str]:
    s.reset(notify={"url": "https://hooks.example/x", "headers": {"X-Token": f"{s.header_token}\u2603"}})
    res = s.fab("status")
    ok = res.returncode == 2 and "notify.headers.X-Token" in res.stderr
    return 0, int(not ok), "inventory: one line naming the header"


def notify_hangs(s: Suite) -> tuple[int, int, str]:
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


def group_kill_9(s: Suite) -> tuple[int, int, str]:
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


def dangling_latest(s: Suite) -> tuple[int, int, str]:
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


def watch_ssh_drop(s: Suite) -> tuple[int, int, str]:
    s.reset(
        run={
            **ct200_target(s.hosts, s.workdir)["run"],
            "overrides": ["--selftest.steps=40", "--selftest.step_seconds=0.2"],
            "env": {"FLEET_FAULT_SECRET": s.secret},
        }
    )
    s.fab("deploy", "train", "--no-warm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_CONFIG=str(s.config), PYTHONUNBUFFERED="1")
    watch = subprocess.Popen(
        [str(FAB), "status", "--watch", "0.5", "--json"],
        cwd=REPO,
        env=env,
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


def override_200k(s: Suite) -> tuple[int, int, str]:
    s.reset(run={**ct200_target(s.hosts, s.workdir)["run"], "overrides": ["--x=" + "a" * 200_000]})
    res = s.fab("train", "--no-warm")
    return 0, int(res.returncode != 2 or "overrides are" not in res.stderr), "inventory: the size, named"


def corrupt_state_files(s: Suite) -> tuple[int, int, str]:
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
    ]:
        s.ct("sh", "-c", 'printf "%s" "$1" > "$2"', "x", junk, f"{run_dir}/{name}")
        for args in (("status", "--json"), ("runs",), ("logs",)):
            res = s.fab(*args)
            wrong += int(res.returncode not in (0, 1, 5, 10, 11, 12, 13))
    return int(not s.runs()), wrong, "5 files x status/runs/logs"


def hostile_override(s: Suite) -> tuple[int, int, str]:
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


def container_stopped(s: Suite) -> tuple[int, int, str]:
    s.reset(container={"type": "pct", "id": s.hosts.stopped_ct_id})
    res = s.fab("status")
    line = res.stderr.strip()
    ok = res.returncode == 3 and str(s.hosts.stopped_ct_id) in line and len(line.splitlines()) == 1
    return 0, int(not ok), "one line naming the container"


def parallel_trains(s: Suite) -> tuple[int, int, str]:
    s.reset()
    s.fab("deploy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_CONFIG=str(s.config))
    procs = [
        subprocess.Popen(
            [str(FAB), "train", "--no-warm"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    codes = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        s.outputs.append(out + err)
        codes.append(p.returncode)
    time.sleep(1)
    live = [r for r in s.runs() if s.trainers(f"{s.workdir}/runs/{r}")]
    wrong = int(sorted(codes) != [0, 5, 5] or len(live) != 1)
    s.stop_all()
    return 0, wrong, f"exits {sorted(codes)}, {len(live)} live"


SCENARIOS: dict[str, Callable[[Suite], tuple[int, int, str]]] = {
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
}
PENDING = {
    "corrupt / truncated newest checkpoint (w-ckpt)": "pending: verified checkpoints are w-ckpt's",
    "parallel first deploys build the env once": "not done: no lock around the env build yet",
}


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
    t0 = time.time()
    try:
        for name, scenario in SCENARIOS.items():
            if wanted and not any(w in name for w in wanted):
                continue
            before, ps_before = len(suite.outputs), len(suite.ps_lines)
            started = time.time()
            try:
                lost, wrong, note = scenario(suite)
            except Exception as err:  # a broken scenario is a row, not the end of the suite
                lost, wrong, note = 0, 1, f"scenario error: {type(err).__name__}: {err}"[:120]
            suite.stop_all()
            outs = suite.outputs[before:]
            rows.append(
                Row(
                    name,
                    lost=lost,
                    wrong=wrong,
                    tracebacks=sum("Traceback (most recent call last)" in o for o in outs),
                    secrets=sum(any(x in o for x in suite.secrets) for o in outs)
                    + len(suite.ps_lines)
                    - ps_before,
                    note=f"{note} ({time.time() - started:.0f} s)",
                )
            )
            suite.ct("rm", "-rf", "--", f"{suite.workdir}/runs", f"{suite.workdir}/envs")
            r = rows[-1]
            print(
                f"{r.fault}: lost {r.lost}, secrets {r.secrets}, tracebacks {r.tracebacks}, "
                f"wrong {r.wrong}; {r.note}",
                flush=True,
            )
    finally:
        stop.set()
        sampler.join(5)
        file_hits = secrets_in_files(suite, t0)
        suite.cleanup()
    rows.extend(Row(name, note=why, pending=True) for name, why in PENDING.items())
    print(table(rows, file_hits))
    return 0


def table(rows: list[Row], file_hits: list[str]) -> str:
    done = [r for r in rows if not r.pending]
    lines = [
        "| fault | runs/ckpts lost | secrets seen | tracebacks | wrong cause | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.pending:
            lines.append(f"| {r.fault} | - | - | - | - | {r.note} |")
        else:
            lines.append(f"| {r.fault} | {r.lost} | {r.secrets} | {r.tracebacks} | {r.wrong} | {r.note} |")
    total = (
        f"| **{len(done)} faults tried** | **{sum(r.lost for r in done)}** | "
        f"**{sum(r.secrets for r in done) + len(file_hits)}** | **{sum(r.tracebacks for r in done)}** | "
        f"**{sum(r.wrong for r in done)}** | "
        f"secrets in container files changed by the suite: {len(file_hits)} |"
    )
    lines.append(total)
    lines.extend(f"  file hit: {h}" for h in file_hits)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
