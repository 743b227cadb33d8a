"""One run over two hosts, end to end: `fab` -> SSH -> pct shim -> LXC containers 200 and 202, one
torchrun agent in each (c10d rendezvous served by 200's agent, gloo on CPU), the real trainer
(tiny-cpu, topology 1+1: the target rank in 200, the drafter rank in 202), each container its own
workdir, env and run dir.

It trains; `fab status` shows both hosts and one verdict; `fab stop` stops both agents and
`fab train` resumes from the checkpoint that only 202 (drafter 0's host) holds; killing 202's
torchrun agent with SIGKILL (its ranks die with it) fails the job within the pipeline timeout,
and the verdict names host ct202.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import testkit

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from testkit import TestHost

pytestmark = pytest.mark.hosts

STEPS = 1000  # never reached: the run is stopped, resumed and then loses a host
TIMEOUT_S = 20  # pipeline.timeout_s: how long a rank waits for a lost peer at most
OVERRIDES = [
    f"--train.steps={STEPS}",
    "--checkpoint.every=4",
    "--checkpoint.keep=2",
    "--train.log_every=1",
    "--eval.num_prompts=0",
    "--eval.every=0",
    f"--pipeline.timeout_s={TIMEOUT_S}",
    "--train.torch_threads=1",
]
UV_CACHE = "/workspace/.fleet-test-uv-cache"  # as the lifecycle test's: torch stays cached
# One workdir per container (named after this checkout's containers: other checkouts' test hosts
# share this machine's process table), kept with its env across runs of the suite (an env is
# ~5 GiB of copies: removing two takes minutes on a busy machine); runs and releases go after.


def ct(hosts: TestHost, cid: int, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hosts.pct, "exec", str(cid), "--", *argv], capture_output=True, text=True, check=check, timeout=60
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Wide:
    """fleet.toml with targets ct200 and ct202 and the run `wide` over both."""

    def __init__(self, hosts: TestHost, config: Path, label: str) -> None:
        self.hosts, self.config, self.label = hosts, config, label
        self.workdir = f"/workspace/{hosts.ct_name}-multihost"
        self.workdirs = {"ct200": f"{self.workdir}-a", "ct202": f"{self.workdir}-b"}
        self.ids = {"ct200": hosts.ct_id, "ct202": hosts.peer_ct_id}
        self.tmux = f"/tmp/{label}-tmux"
        self.port = free_port()
        self.write()

    def write(self, restart: str = "") -> None:
        """The inventory; ``restart``: the run's restart policy, e.g. ``{ max = 3, backoff_s = 5 }``."""
        hosts = self.hosts
        lines = ['default_target = "ct200"', ""]
        for name, cid in self.ids.items():
            lines += [
                f"[targets.{name}]",
                f'host = "{hosts.host}"',
                f'identity_file = "{hosts.identity}"',
                f'known_hosts = "{hosts.known_hosts}"',
                f'container = {{ type = "pct", id = {cid} }}',
                f'workdir = "{self.workdirs[name]}"',
                'env = "local-cpu"',
                f'uv_cache = "{UV_CACHE}"',
                f'commands = {{ pct = "{hosts.pct}", tmux = "{self.tmux}" }}',
                "",
            ]
        lines += [
            "[runs.wide]",
            'targets = ["ct200", "ct202"]',
            'topology = "1+1"',
            f'rendezvous = "127.0.0.1:{self.port}"',
            'network = { ct200 = { addr = "127.0.0.1", socket_ifname = "lo" }, '
            'ct202 = { addr = "127.0.0.2", socket_ifname = "lo" } }',
            f'run = {{ config = "tiny-cpu", overrides = {json.dumps(OVERRIDES)}'
            + (f", restart = {restart}" if restart else "")
            + " }",
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def fab(self, *args: str, target: str = "wide", timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return testkit.fab(*args, config=self.config, timeout=timeout, env={"FLEET_TARGET": target})

    def read(self, name: str, path: str) -> str:
        result = ct(self.hosts, self.ids[name], "cat", "--", f"{self.workdirs[name]}/{path}")
        return result.stdout if result.returncode == 0 else ""

    def events(self, name: str, run_id: str) -> list[dict[str, Any]]:
        text = self.read(name, f"runs/{run_id}/events.jsonl")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def last_step(self, run_id: str) -> int:
        steps = [e["step"] for e in self.events("ct202", run_id) if e["event"] == "step"]
        return steps[-1] if steps else 0

    def kill_agent(self, name: str) -> None:
        """SIGKILL the torchrun agent of host ``name`` (not its wrapper, run.sh)."""
        agents = [
            line.split()[0]
            for line in ct(self.hosts, self.ids[name], "ps", "-eo", "pid=,args=").stdout.splitlines()
            if line.split()[2:4] == ["-m", "training.launch"] and self.workdirs[name] in line
        ]
        assert len(agents) == 1, agents
        ct(self.hosts, self.ids[name], "kill", "-9", agents[0], check=True)

    def status(self) -> dict[str, Any]:
        result = self.fab("status", "--json")
        assert "Traceback" not in result.stderr, result.stderr
        return json.loads(result.stdout)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def wide(hosts: TestHost, tmp_path: Path) -> Iterator[Wide]:
    if not hosts.peer_ct_id:
        pytest.fail("tests/hosts/setup predates container 202: run it again", pytrace=False)
    label = f"fleet-test-{uuid.uuid4().hex[:10]}"
    fleet = Wide(hosts, tmp_path / "fleet.toml", label)
    for cid in fleet.ids.values():
        ct(hosts, cid, "sh", "-c", f"printf '#!/bin/sh\\nexec tmux -L {label} \"$@\"\\n' > {fleet.tmux}")
        ct(hosts, cid, "chmod", "755", fleet.tmux, check=True)
    yield fleet
    fleet.fab("stop", "--force", timeout=120)
    for cid in fleet.ids.values():
        ct(hosts, cid, "tmux", "-L", label, "kill-server")
    testkit.kill_processes_naming(label)
    testkit.kill_processes_naming(fleet.workdir)
    for name, cid in fleet.ids.items():
        kept = [f"{fleet.workdirs[name]}/{d}" for d in ("runs", "releases", "current", "data-cache")]
        ct(hosts, cid, "rm", "-rf", "--", *kept, fleet.tmux)


def test_a_run_over_two_containers_trains_resumes_and_names_a_lost_host(wide: Wide) -> None:
    hosts = wide.hosts
    started = ok(wide.fab("deploy", "train", "--no-warm", timeout=1200))
    assert "ct200: node 0, ranks 0-0 (1 target, 0 drafter)" in started.stdout, started.stdout
    assert "ct202: node 1, ranks 1-1 (0 target, 1 drafter)" in started.stdout
    assert "checkpoints on ct202" in started.stdout
    run_id = ct(hosts, hosts.ct_id, "readlink", f"{wide.workdirs['ct200']}/runs/latest").stdout.strip()
    assert (
        run_id
        and run_id
        == ct(hosts, hosts.peer_ct_id, "readlink", f"{wide.workdirs['ct202']}/runs/latest").stdout.strip()
    )
    releases = {json.loads(wide.read(n, f"runs/{run_id}/run.json"))["release"] for n in wide.ids}
    assert len(releases) == 1, releases

    # 1. It trains: the drafter's steps in 202, the target's forward in 200, each host's own events.
    testkit.wait_for("step 6", lambda: wide.last_step(run_id) >= 6, timeout=300, interval=0.5)
    st = wide.status()
    assert (st["run"], st["run_id"], st["state"]) == ("wide", run_id, "training"), st
    assert [h["target"] for h in st["hosts"]] == ["ct200", "ct202"]
    roles = {
        n: {e.get("role") for e in wide.events(n, run_id) if e["event"] == "run_start"} for n in wide.ids
    }
    assert roles == {"ct200": {"target"}, "ct202": {"drafter"}}, roles
    hosts_seen = {e["host"] for n in wide.ids for e in wide.events(n, run_id) if e["event"] == "run_start"}
    assert hosts_seen == {"ct200", "ct202"}
    logs = ok(wide.fab("logs", "-n", "40")).stdout  # every host's log, each under its name
    assert "== ct200 " in logs and "== ct202 " in logs and "drafter 0, batch" in logs, logs
    plan = ok(wide.fab("plan")).stdout  # tiny-cpu: 3 target layers x 128 hidden x 4 B (CPU: fp32)
    assert "ct200 -> ct202: 100% of the batches" in plan and "1,536 B per token" in plan, plan
    table = ok(wide.fab("status")).stdout
    assert "ct200" in table and "ct202" in table and f"wide (run {run_id}): training" in table, table

    # 2. `fab stop` stops both agents (drafter 0 checkpoints); `fab train` resumes from 202's checkpoint.
    ok(wide.fab("stop"))
    k = wide.last_step(run_id)
    assert k < STEPS
    st = wide.status()
    assert st["state"] == "stopped" and {h["state"] for h in st["hosts"]} == {"stopped"}, st
    assert ct(
        hosts, hosts.ct_id, "test", "-e", f"{wide.workdirs['ct200']}/runs/{run_id}/checkpoints"
    ).returncode
    resumed = ok(wide.fab("train", "--no-warm"))
    assert f"run {run_id} resumed at step {k + 1}" in resumed.stdout, resumed.stdout
    testkit.wait_for("more steps", lambda: wide.last_step(run_id) >= k + 3, timeout=300, interval=0.5)
    assert [e["step"] for e in wide.events("ct202", run_id) if e["event"] == "resume"] == [k]
    # The targets continue the data where drafter 0 left it (its step, broadcast), not at 0.
    batches = [
        e.get("batch") for e in wide.events("ct202", run_id) if e["event"] == "step" and e["step"] == k + 1
    ]
    assert batches and batches[-1] == k, batches

    # 3. 202's agent killed: the job fails within the pipeline timeout, and the verdict names ct202.
    killed_at = time.monotonic()
    wide.kill_agent("ct202")
    holder: dict[str, Any] = {}

    def ended() -> bool:
        holder["st"] = wide.status()
        return all(h.get("alive") is False for h in holder["st"]["hosts"])

    testkit.wait_for("both hosts to end", ended, timeout=TIMEOUT_S * 6, interval=1.0)
    took = time.monotonic() - killed_at
    st = holder["st"]
    assert st["state"] == "failed" and st["lost_hosts"] == ["ct202"], st
    assert "host ct202 lost" in st["cause"], st
    ct200 = st["hosts"][0]
    assert ct200["state"] == "failed" and "ct202" in ct200["last_error"]["message"], ct200
    print(f"job failed {took:.1f}s after 202's agent was killed (pipeline.timeout_s = {TIMEOUT_S})")
    text = wide.fab("status")
    assert text.returncode == 12 and "failed: host ct202 lost" in text.stdout, text.stdout

    # 4. With a restart policy, each host's wrapper restarts its own agent after a failure; the
    # agents meet again at the rendezvous and continue from drafter 0's newest checkpoint.
    wide.write(restart="{ max = 3, backoff_s = 5 }")
    again = ok(wide.fab("train", "--no-warm"))
    assert f"run {run_id} resumed at step" in again.stdout, again.stdout
    before = wide.last_step(run_id)
    testkit.wait_for("steps after the resume", lambda: wide.last_step(run_id) >= before + 3, timeout=300)
    wide.kill_agent("ct202")
    lost_at = wide.last_step(run_id)

    def restarted() -> bool:
        holder["st"] = wide.status()
        return all(h["attempt"] >= 2 for h in holder["st"]["hosts"]) and wide.last_step(run_id) >= lost_at + 3

    testkit.wait_for("both agents restarted and training again", restarted, timeout=300, interval=1.0)
    assert {h["last_cause"] for h in holder["st"]["hosts"]} <= {"exit 1", "exit 137"}, holder["st"]
    resumes = [e["step"] for e in wide.events("ct202", run_id) if e["event"] == "resume"]
    assert len(resumes) >= 3 and resumes[-1] <= lost_at, resumes
    ok(wide.fab("stop"))
    assert wide.status()["state"] == "stopped"
