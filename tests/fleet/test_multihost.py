"""Runs over several hosts (``[runs.NAME]``): the inventory validates them as a whole, each host's
torchrun command, and the one verdict of ``fab status`` over all hosts. The real two-container
run is tests/e2e/test_multihost_e2e.py."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import testkit

from fleet.errors import ConfigError
from fleet.inventory import Inventory, parse_inventory, select_run, select_targets
from fleet.multihost import verdict
from fleet.runs import NodeLaunch
from fleet.status.model import ErrorInfo, RunStatus

FAB = Path(sys.executable).parent / "fab"

HOSTS = """
default_target = "pve1"
[targets.pve1]
host = "root@pve1.example"
workdir = "/workspace/fleet"
gpus = 8
env = "train"
[targets.pve2]
host = "root@pve2.example"
workdir = "/workspace/fleet"
gpus = 8
env = "train"
"""

WIDE = """
[runs.wide]
targets = ["pve1", "pve2"]
topology = "10+6"
rendezvous = "10.0.0.1:29400"
network = { pve1 = { addr = "10.0.0.1", socket_ifname = "ens1" }, pve2 = { addr = "10.0.0.2" } }
run = { config = "qwen3.6-27b-5p3", overrides = ["--train.steps=9"] }
"""


def parse(text: str, path: Path = Path("/x/fleet.toml")) -> Inventory:
    return parse_inventory(tomllib.loads(text), path)


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse(text)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_run_over_two_hosts_is_placed_host_by_host() -> None:
    inv = parse(HOSTS + WIDE)
    run = inv.runs["wide"]
    assert [(n.target, n.nproc, n.addr, n.socket_ifname) for n in run.nodes] == [
        ("pve1", 8, "10.0.0.1", "ens1"),
        ("pve2", 8, "10.0.0.2", ""),
    ]
    # ranks 0-7 on pve1 are targets; pve2 runs targets 8-9 and the 6 drafters (rank 10 = drafter 0)
    assert (run.split(0), run.split(1)) == ((8, 0), (2, 6))
    assert run.checkpoint_node == 1 and run.node_of_rank(7) == 0 and run.node_of_rank(8) == 1
    assert run.run.overrides == ("--train.steps=9",)


def test_fleet_target_selects_the_run_and_its_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = parse(HOSTS + WIDE)
    monkeypatch.setenv("FLEET_TARGET", "wide")
    assert select_run(inv) is inv.runs["wide"]
    members = select_targets(inv, allow_all=True)  # read-only tasks: every host, the run's run spec
    assert [m.name for m in members] == ["pve1", "pve2"]
    assert all(m.run.config == "qwen3.6-27b-5p3" and m.topology is None for m in members)
    with pytest.raises(ConfigError, match="a run over several hosts"):
        select_targets(inv, allow_all=False)
    monkeypatch.setenv("FLEET_TARGET", "pve2")
    assert select_run(inv) is None


def test_each_host_runs_one_torchrun_agent_of_the_c10d_rendezvous() -> None:
    inv = parse(HOSTS + WIDE)
    run = inv.runs["wide"]
    spec = select_targets(inv, "wide", allow_all=True)[1]
    node = NodeLaunch(run, 1)
    argv = node.argv(spec, "/workspace/fleet/runs/R", "R")
    assert argv[:11] == [
        "/workspace/fleet/envs/train/current/bin/python",
        "-m",
        "training.launch",
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=R",
        "--rdzv-conf=is_host=false",
        "--local-addr=10.0.0.2",
    ]
    assert argv[11:] == [
        "-m",
        "training",
        "train",
        "--config",
        "qwen3.6-27b-5p3",
        "--run-dir",
        "/workspace/fleet/runs/R",
        "--train.steps=9",
        "--topology",
        "10+6",
        "--placement",
        "8+0,2+6",
    ]
    assert "--rdzv-conf=is_host=true" in NodeLaunch(run, 0).argv(spec, "/r", "R")
    assert NodeLaunch(run, 0).env(spec) == {
        "FLEET_NODE_NAME": "pve2",
        "NCCL_SOCKET_IFNAME": "ens1",
        "GLOO_SOCKET_IFNAME": "ens1",
    }
    assert node.env(spec) == {"FLEET_NODE_NAME": "pve2"}
    assert node.record()["checkpoint_host"] == "pve2"


def test_per_host_split_and_cpu_hosts() -> None:
    ok = WIDE.replace('topology = "10+6"', 'topology = "10+6"\nper_host = { pve1 = "8+0", pve2 = "2+6" }')
    assert [n.nproc for n in parse(HOSTS + ok).runs["wide"].nodes] == [8, 8]
    cpu = (HOSTS + WIDE).replace("gpus = 8", "gpus = 0").replace('"10+6"', '"1+1"')
    assert [n.nproc for n in parse(cpu).runs["wide"].nodes] == [1, 1]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (('topology = "10+6"', 'topology = "10+5"'), "needs 15 GPUs but its targets have 8 + 8 = 16"),
        (('"10.0.0.2"', '"10.0.0.0"'), "numbers the hosts by their address, sorted as text"),
        (('pve2 = { addr = "10.0.0.2" }', "pve2 = {}"), "network.pve2.addr is missing"),
        (('targets = ["pve1", "pve2"]', 'targets = ["pve1"]'), "two or more distinct targets"),
        (('targets = ["pve1", "pve2"]', 'targets = ["pve1", "pve9"]'), "'pve9' is not a target"),
        (('"10.0.0.1:29400"', '"10.0.0.1"'), 'is not "host:port"'),
        (
            ('topology = "10+6"', 'topology = "10+6"\nper_host = { pve1 = "9+0", pve2 = "1+6" }'),
            "needs 9 GPUs",
        ),
        (
            ('topology = "10+6"', 'topology = "10+6"\nper_host = { pve1 = "8+0", pve2 = "2+5" }'),
            "does not add up",
        ),
        (("run = { config", 'run = { module = "other", config'), "needs the bundled trainer"),
        (("[runs.wide]", "[runs.pve1]"), "no target's name"),
    ],
)
def test_a_bad_run_is_refused_in_one_line(change: tuple[str, str], expected: str) -> None:
    assert change[0] in WIDE
    assert expected in refused(HOSTS + WIDE.replace(*change))


def test_targets_on_different_envs_are_refused() -> None:
    text = HOSTS.replace('env = "train"\n', 'env = "train2"\n', 1)
    assert "different envs (pve1 env = 'train2', pve2 env = 'train')" in refused(text + WIDE)


def test_fab_refuses_a_bad_run_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(HOSTS + WIDE.replace('"10.0.0.2"', '"10.0.0.0"'))
    result = testkit.fab("stop", config=path, env={"FLEET_TARGET": "wide"}, in_process=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "sorted as text" in result.stderr


def _status(target: str, state: str, error: str = "", peer_host: str = "") -> RunStatus:
    fields = dict.fromkeys(RunStatus.__dataclass_fields__)
    fields.update(
        target=target,
        run_id="R",
        release="",
        env="",
        state=state,
        phase="",
        tokens_per_s_by_role={},
        gpus=(),
        diagnosis=(),
        last_error=ErrorInfo("RankLost", error, peer_host) if error else None,
    )
    for key in ("segments", "attempt"):
        fields[key] = 1
    for key in ("notes", "targets", "history"):
        fields[key] = ()
    fields["last_cause"] = ""
    return RunStatus(**fields)


def test_one_verdict_names_the_lost_host() -> None:
    run = parse(HOSTS + WIDE).runs["wide"]
    lost = (
        "rank 0 (target 0 on host pve1, pid 9, cpu): lost rank 10 (drafter 0 on host pve2, pid 7, cpu): reset"
    )
    # the error event's peer_host names the lost host (the prose is for people, never parsed)
    summary = verdict(
        run, [("pve1", _status("pve1", "failed", lost, "pve2")), ("pve2", _status("pve2", "failed"))]
    )
    assert (summary["state"], summary["exit_code"], summary["lost_hosts"]) == ("failed", 12, ["pve2"])
    assert summary["cause"].startswith("host pve2 lost") and summary["run_id"] == "R"
    both = verdict(run, [("pve1", _status("pve1", "training")), ("pve2", _status("pve2", "stopped"))])
    assert (both["state"], both["exit_code"], both["lost_hosts"]) == ("stopped", 10, [])


def test_plan_says_what_crosses_the_network_and_its_bandwidth() -> None:
    from fleet.doctor import RunNeeds
    from fleet.multihost import network_plan, plan_text

    run = parse(HOSTS + WIDE).runs["wide"]  # pve1: targets 0-7; pve2: targets 8-9 + 6 drafters
    needs = RunNeeds("c", known=True, hidden_size=5120, target_layers=5, dtype_bytes=2, drafter_params=10**9)
    plan = network_plan(run, needs, 20_000)
    # every drafter is on pve2: pve1's 8 of 10 targets send all their hidden states across
    assert [(link["from"], link["to"]) for link in plan["links"]] == [("pve1", "pve2")]
    assert plan["links"][0]["share"] == pytest.approx(0.8)
    per_token = 5 * 5120 * 2
    assert plan["links"][0]["bytes_per_s"] == pytest.approx(0.8 * 20_000 * per_token)
    assert not plan["ddp_across_hosts"]
    text = plan_text(plan)
    assert "pve1 -> pve2: 80% of the batches, 819.2 MB/s (6.55 Gbit/s)" in text, text
    split = parse(HOSTS + WIDE.replace('"10+6"', '"10+6"\nper_host = { pve1 = "8+0", pve2 = "2+6" }'))
    assert network_plan(split.runs["wide"], needs, 20_000)["links"] == plan["links"]


def test_a_per_host_split_keeps_hidden_states_on_their_host() -> None:
    from fleet.doctor import RunNeeds
    from fleet.multihost import network_plan, plan_text
    from training.contract import parse_placement, parse_topology

    text = HOSTS + WIDE.replace('"10+6"', '"10+6"\nper_host = { pve1 = "5+3", pve2 = "5+3" }')
    run = parse(text).runs["wide"]
    assert run.placement == "5+3,5+3" and run.checkpoint_node == 0
    topo = parse_placement(parse_topology("10+6"), run.placement)
    # pve1: ranks 0-4 targets 0-4, 5-7 drafters 0-2; pve2: ranks 8-12 targets 5-9, 13-15 drafters 3-5
    assert [topo.role_of(r) for r in (0, 4, 5, 7, 8, 12, 13, 15)] == [
        ("target", 0), ("target", 4), ("drafter", 0), ("drafter", 2),
        ("target", 5), ("target", 9), ("drafter", 3), ("drafter", 5),
    ]  # fmt: skip
    assert topo.partners(0) == [5, 6, 7] and topo.partners(12) == [13, 14, 15]
    needs = RunNeeds("c", known=True, hidden_size=5120, target_layers=5, dtype_bytes=2, drafter_params=10**9)
    plan = network_plan(run, needs, 20_000)
    assert plan["links"] == [] and plan["ddp_across_hosts"], plan
    text_out = plan_text(plan)
    assert "hidden states stay on their hosts" in text_out and "8,000.0 MB of gradients" in text_out, text_out
    # a host of drafters only: its drafters are fed from everywhere, so every target sends to all
    lone = parse_placement(parse_topology("2+2"), "2+1,0+1")
    assert lone.partners(0) == [2, 3]
