"""The inventory: valid files parse into the documented dataclasses; every mistake is one line.

The error cases go through the real `fab` entry point (Fabric's program, in process; one of them
also as the `fab` subprocess, which must say exactly the same), FLEET_CONFIG pointing at the bad
file: exit code 2, one line on stderr naming the key, no traceback, nothing created.
"""

from __future__ import annotations

import getpass
import os
import subprocess
from pathlib import Path

import pytest
import testkit

from fleet.errors import ConfigError
from fleet.inventory import (
    Commands,
    ContainerSpec,
    GateSpec,
    RunSpec,
    Topology,
    load_inventory,
    select_targets,
)

REPO = Path(__file__).resolve().parents[2]

LOCAL = """
default_target = "local"
[targets.local]
host = "local"
workdir = "state/local"
"""

PVE = """
[targets.pve]
host = "root@pve.example:2222"
identity_file = "keys/id"
known_hosts = "~/kh"
container = { type = "pct", id = 200 }
workdir = "/workspace/fleet"
gpus = 8
topology = "5+3"
env = "train"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def fab(config: Path, *args: str, target: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real `fab` entry point, in process (the CLI itself: `test_the_cli_process_says_the_same`)."""
    env = {"FLEET_TARGET": target} if target is not None else None
    return testkit.fab(*args, config=config, env=env, in_process=True)


# --- valid inventories -----------------------------------------------------------------------------


def test_full_inventory_parses_into_dataclasses(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, LOCAL + PVE))
    assert inv.path == tmp_path / "fleet.toml"
    assert inv.default_target == "local"
    assert list(inv.targets) == ["local", "pve"]

    local = inv.targets["local"]
    assert local.is_local and local.ssh is None and local.container is None
    assert local.workdir == str(tmp_path / "state" / "local")  # relative to the inventory file
    assert local.gpus == 0 and local.topology is None and local.env == ""
    assert local.commands == Commands()
    assert local.run == RunSpec()
    assert local.gpu_gate == GateSpec()
    assert (local.keep_releases, local.stall_window_s, local.llamacpp) == (5, 600.0, "off")
    assert local.layout.current == f"{local.workdir}/current"

    pve = inv.targets["pve"]
    assert pve.ssh is not None
    assert (pve.ssh.user, pve.ssh.hostname, pve.ssh.port) == ("root", "pve.example", 2222)
    assert pve.ssh.identity_file == str(tmp_path / "keys" / "id")
    assert pve.ssh.known_hosts == os.path.expanduser("~/kh")
    assert pve.ssh.host_key_policy == "strict"
    assert pve.container == ContainerSpec(type="pct", id=200)
    assert pve.workdir == "/workspace/fleet"
    assert pve.topology == Topology(targets=5, drafters=3) and str(pve.topology) == "5+3"
    assert pve.display == "root@pve.example:2222 container 200"


def test_optional_sections_and_variants(tmp_path: Path) -> None:
    text = """
[targets.a]
host = "[::1]:2200"
workdir = "/w"
container = { type = "lxc", name = "train.1" }
host_key_policy = "accept-new"
[targets.a.run]
module = "training.selftest"
config = "configs/x.toml"
overrides = ["--train.steps=5"]
env = { HF_TOKEN = "hf_secret_value" }
[targets.a.commands]
pct = "/opt/shims/pct"
tmux = "/usr/bin/tmux"
[targets.a.gpu_gate]
max_memory_mib = 10
expected_name = "NVIDIA H200"
timeout_s = 5
[targets.b]
host = "local"
workdir = "~/fleet-b"
container = { type = "pct", id = "201" }
"""
    inv = load_inventory(write(tmp_path, text))
    assert inv.default_target == "a"  # the first target when not given
    a = inv.targets["a"]
    assert a.ssh is not None and (a.ssh.user, a.ssh.hostname, a.ssh.port) == (getpass.getuser(), "::1", 2200)
    assert a.ssh.host_key_policy == "accept-new"
    assert a.container == ContainerSpec(type="lxc", name="train.1")
    assert a.run.overrides == ("--train.steps=5",) and a.run.config == "configs/x.toml"
    assert dict(a.run.env) == {"HF_TOKEN": "hf_secret_value"}
    assert "hf_secret_value" not in repr(a)  # run env values are secrets
    assert a.commands.pct == "/opt/shims/pct" and a.commands.uv == "uv"
    assert a.gpu_gate == GateSpec(max_memory_mib=10, expected_name="NVIDIA H200", timeout_s=5.0)
    b = inv.targets["b"]
    assert b.workdir == os.path.expanduser("~/fleet-b")
    assert b.container == ContainerSpec(type="pct", id=201)  # a numeric string is a number


def test_hostile_values_are_kept_literally(tmp_path: Path) -> None:
    # Nothing here is rejected: these strings only ever travel as argv elements.
    text = """
[targets.x]
host = "root@h:22"
workdir = "/srv/a b;touch /tmp/x $(id) `id` 'q' \\"d\\""
"""
    spec = load_inventory(write(tmp_path, text)).targets["x"]
    assert spec.workdir == "/srv/a b;touch /tmp/x $(id) `id` 'q' \"d\""


def test_shipped_inventory_is_the_local_default() -> None:
    inv = load_inventory(REPO / "fleet.toml")
    assert inv.default_target == "local"
    local = inv.targets["local"]
    assert local.is_local and local.gpus == 0 and local.env == "local-cpu"
    assert local.workdir == str(REPO / ".fleet" / "local")
    assert (local.run.module, local.run.config) == ("training", "smol-cpu")


def test_one_default_inventory_whatever_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fab` (fleet.cli) and load_inventory() read the same file: $FLEET_CONFIG, else the checkout's."""
    from fleet import cli

    monkeypatch.delenv("FLEET_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_inventory().path == cli.inventory().path == REPO / "fleet.toml"
    other = write(tmp_path, LOCAL)
    monkeypatch.setenv("FLEET_CONFIG", str(other))
    assert load_inventory().path == cli.inventory().path == other


def test_select_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = load_inventory(write(tmp_path, LOCAL + PVE))
    monkeypatch.delenv("FLEET_TARGET", raising=False)
    assert [t.name for t in select_targets(inv, allow_all=False)] == ["local"]
    monkeypatch.setenv("FLEET_TARGET", "pve")
    assert [t.name for t in select_targets(inv, allow_all=False)] == ["pve"]
    monkeypatch.setenv("FLEET_TARGET", "all")
    assert [t.name for t in select_targets(inv, allow_all=True)] == ["local", "pve"]
    with pytest.raises(ConfigError, match="only allowed for read-only"):
        select_targets(inv, allow_all=False)
    with pytest.raises(ConfigError, match="use one of: local, pve"):
        select_targets(inv, "nope", allow_all=True)


# --- every mistake: one line, through the real `fab` -------------------------------------------------

BAD = {
    "syntax": (LOCAL + "gpus = = 1\n", "line 6"),
    "unknown-top-key": ("colour = 1\n" + LOCAL, "unknown key colour; allowed here: default_target, targets"),
    "unknown-target-key": (LOCAL + "gpu = 1\n", "unknown key targets.local.gpu; allowed here: host,"),
    "unknown-run-key": (LOCAL + "[targets.local.run]\nconfg = 'x'\n", "unknown key targets.local.run.confg"),
    "unknown-command": (LOCAL + "[targets.local.commands]\nsmi = 'x'\n", "targets.local.commands.smi"),
    "wrong-type": (LOCAL + 'gpus = "8"\n', "targets.local.gpus must be an integer >= 0, not a string"),
    "bool-is-not-int": (LOCAL + "keep_releases = true\n", "targets.local.keep_releases must be an integer"),
    "negative": (LOCAL + "keep_releases = 0\n", "targets.local.keep_releases = 0 must be >= 1"),
    "llamacpp-mode": (
        LOCAL + 'llamacpp = "gpu"\n',
        'targets.local.llamacpp = \'gpu\': use "off", "cpu" or "auto"',
    ),
    "pct-id-not-numeric": (LOCAL + PVE.replace("id = 200", 'id = "ct200"'), "targets.pve.container.id"),
    "container-type": (LOCAL + PVE.replace('type = "pct"', 'type = "docker"'), "targets.pve.container.type"),
    "lxc-without-name": (LOCAL + PVE.replace('type = "pct", id = 200', 'type = "lxc"'), "container.name"),
    "bad-target-name": (LOCAL + '[targets."my box"]\nhost = "local"\nworkdir = "w"\n', "'my box'"),
    "bad-env-name": (LOCAL + PVE.replace('env = "train"', 'env = "../x"'), "targets.pve.env"),
    "topology-sum": (LOCAL + PVE.replace('"5+3"', '"5+2"'), "targets.pve.topology = '5+2' sums to 7"),
    "topology-form": (LOCAL + PVE.replace('"5+3"', '"5x3"'), 'is not "N+M"'),
    "remote-relative-workdir": (LOCAL + PVE.replace("/workspace/fleet", "workspace"), "targets.pve.workdir"),
    "host-form": (LOCAL + PVE.replace("root@pve.example:2222", "root@@pve"), "targets.pve.host"),
    "port-range": (LOCAL + PVE.replace(":2222", ":70000"), "port 70000 is out of range"),
    "key-policy": (LOCAL + PVE + 'host_key_policy = "yes"\n', "targets.pve.host_key_policy"),
    "ssh-key-on-local": (LOCAL + 'identity_file = "x"\n', "targets.local.identity_file only applies"),
    "missing-workdir": ('[targets.local]\nhost = "local"\n', "targets.local.workdir is missing"),
    "missing-host": ('[targets.local]\nworkdir = "w"\n', "targets.local.host is missing"),
    "run-env-key": (LOCAL + "[targets.local.run]\nenv = { 'A-B' = 'x' }\n", "targets.local.run.env: 'A-B'"),
    "run-env-value": (
        LOCAL + "[targets.local.run]\nenv = { TOKEN = 123 }\n",
        "run.env.TOKEN must be a string",
    ),
    "overrides": (LOCAL + "[targets.local.run]\noverrides = '--x=1'\n", "run.overrides must be a list"),
    "overrides-200k": (
        LOCAL + f"[targets.local.run]\noverrides = ['--x={'a' * 200_000}']\n",
        "run.overrides are 200005 bytes in all",
    ),
    "notify-url-control": (
        LOCAL + '[targets.local.notify]\nurl = "https://hooks.example/t0ken\\u0007"\n',
        "notify.url must be an http:// or https:// URL of printable ASCII",
    ),
    "default-target": (
        LOCAL.replace('"local"\n[', '"nope"\n[', 1),
        "default_target = 'nope' is not a target",
    ),
    "no-targets": ('default_target = "local"\n', "no targets"),
    "workdir-root": (LOCAL + PVE.replace('"/workspace/fleet"', '"/"'), "targets.pve.workdir = '/' would put"),
    "workdir-usr": (LOCAL + PVE.replace('"/workspace/fleet"', '"/usr"'), "fleet's tree (bin/, envs/"),
    "workdir-under-etc": (LOCAL + PVE.replace('"/workspace/fleet"', '"/etc/fleet"'), "into /etc"),
    "workdir-var-lib": (LOCAL + PVE.replace('"/workspace/fleet"', '"/var/lib/"'), "into /var/lib;"),
    "workdir-dotdot": (LOCAL + PVE.replace('"/workspace/fleet"', '"/workspace/../etc"'), "goes through '..'"),
    "local-workdir-dotdot": (LOCAL.replace('"state/local"', '"state/../../x"'), "targets.local.workdir"),
    "local-workdir-home": (LOCAL.replace('"state/local"', '"~"'), "targets.local.workdir = '~' would put"),
    "override-nul": (LOCAL + '[targets.local.run]\noverrides = ["--a=b\\u0000c"]\n', "overrides[0]"),
    "env-value-nul": (
        LOCAL + "[targets.local.run]\nenv = { K = 'x' }\n".replace("'x'", '"s3\\u0000cret"'),
        "run.env.K has a NUL",
    ),
    "identity-nul": (LOCAL + PVE.replace('"keys/id"', '"keys/\\u0000id"'), "targets.pve.identity_file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inventory_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    text, expected = BAD[case]
    result = fab(write(tmp_path, text), "status")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"fleet: {tmp_path / 'fleet.toml'}: "), lines[0]
    assert expected in lines[0]
    assert "s3" not in lines[0] or case != "env-value-nul"  # a run.env value is never shown
    assert not (tmp_path / "state").exists()  # validated before anything ran


def test_the_cli_process_says_the_same(tmp_path: Path) -> None:
    """The `fab` console script as a subprocess: the same exit code and output as in process."""
    text, expected = BAD["topology-sum"]
    config = write(tmp_path, text)
    spawned = testkit.fab("status", config=config)
    assert spawned.returncode == 2 and expected in spawned.stderr, spawned.stderr
    in_process = fab(config, "status")
    assert (spawned.returncode, spawned.stdout, spawned.stderr) == (
        in_process.returncode,
        in_process.stdout,
        in_process.stderr,
    )


def test_unknown_fleet_target_and_all_for_a_changing_task(tmp_path: Path) -> None:
    config = write(tmp_path, LOCAL + PVE)
    unknown = fab(config, "status", target="nope")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip() == (
        f"fleet: FLEET_TARGET='nope' is not in {config}; use one of: local, pve or all"
    )
    everything = fab(config, "deploy", target="all")
    assert everything.returncode == 2 and len(everything.stderr.strip().splitlines()) == 1
    assert "FLEET_TARGET=all is only allowed for read-only tasks" in everything.stderr
    assert not (tmp_path / "state").exists()


def test_missing_inventory_file(tmp_path: Path) -> None:
    result = fab(tmp_path / "absent.toml", "status")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"fleet: {tmp_path / 'absent.toml'}: inventory not found; "
        "create it (see README) or point FLEET_CONFIG at one"
    )


def test_restart_notify_and_keep_runs(tmp_path: Path) -> None:
    text = """
[targets.a]
host = "local"
workdir = "/tmp/w"
keep_runs = 3
[targets.a.run]
restart = { max = 2, backoff_s = 30 }
[targets.a.notify]
url = "https://hooks.example/T000/secret-part"
headers = { Authorization = "Bearer secret-header" }
command = ["/usr/local/bin/page-me", "--fleet"]
"""
    spec = load_inventory(write(tmp_path, text)).targets["a"]
    assert (spec.keep_runs, spec.run.restart_max, spec.run.restart_backoff_s) == (3, 2, 30.0)
    assert spec.notify.enabled and spec.notify.command == ("/usr/local/bin/page-me", "--fleet")
    assert "secret" not in repr(spec)  # URL and header values may be tokens
    defaults = load_inventory(write(tmp_path, '[targets.a]\nhost = "local"\nworkdir = "/tmp/w"\n')).targets[
        "a"
    ]
    assert (defaults.keep_runs, defaults.run.restart_max, defaults.notify.enabled) == (10, 0, False)
    bad = text.replace("https://hooks.example/T000/secret-part", "ftp://x/secret-part")
    with pytest.raises(ConfigError) as err:
        load_inventory(write(tmp_path, bad))
    assert "notify.url" in str(err.value) and "secret" not in str(err.value)
    with pytest.raises(ConfigError, match=r"restart\.max = -1 must be >= 0"):
        load_inventory(write(tmp_path, text.replace("max = 2", "max = -1")))


# --- the run's shape: the run config read once, at load, with the trainer's loader ------------------

ONE_GPU_27B = LOCAL + 'gpus = 1\n[targets.local.run]\nconfig = "qwen3.6-27b-random"\n'


def test_run_config_is_loaded_with_the_trainers_loader(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, LOCAL + '[targets.local.run]\noverrides = ["--train.steps=7"]\n'))
    loaded = inv.targets["local"].run.loaded
    assert loaded is not None and loaded.name == "tiny-cpu" and loaded.train.steps == 7
    bad = write(tmp_path, LOCAL + '[targets.local.run]\noverrides = ["--train.stepz=7"]\n')
    with pytest.raises(ConfigError, match=r"targets\.local\.run: override --train\.stepz: unknown key"):
        load_inventory(bad)


def test_config_topology_is_the_default_and_the_inventorys_wins(tmp_path: Path) -> None:
    eight = ONE_GPU_27B.replace("gpus = 1", "gpus = 8")
    assert load_inventory(write(tmp_path, eight)).targets["local"].topology == Topology(5, 3)
    mine = eight.replace("gpus = 8", 'gpus = 8\ntopology = "6+2"')
    assert load_inventory(write(tmp_path, mine)).targets["local"].topology == Topology(6, 2)
    single = ONE_GPU_27B + 'overrides = ["--pipeline.topology="]\n'
    assert load_inventory(write(tmp_path, single)).targets["local"].topology is None


def test_train_refuses_a_config_topology_that_does_not_fit_gpus(tmp_path: Path) -> None:
    result = fab(write(tmp_path, ONE_GPU_27B), "train")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"fleet: {tmp_path / 'fleet.toml'}: targets.local.run.config = 'qwen3.6-27b-random' has "
        'pipeline.topology = "5+3" (8 GPUs) but targets.local.gpus = 1; set targets.local.gpus and '
        'targets.local.topology to agree, or add "--pipeline.topology=" to targets.local.run.overrides '
        "for one process"
    )
    assert not (tmp_path / "state").exists()  # refused before anything ran
