"""`fab data` / `fab regen` on the controller: the inventory's regen servers, the argv sent to the
target (each value one argv item, never a shell string), the one-line refusal without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import runs
from fleet.errors import ConfigError
from fleet.inventory import load_inventory
from fleet.target import Target

INVENTORY = """
default_target = "x"
[targets.x]
host = "local"
workdir = "{workdir}"
[targets.x.run]
config = "tiny-cpu"
regen_servers = ["10.0.0.5:30000", "http://10.0.0.6:8000/v1"]
"""


def test_regen_servers_in_the_inventory_and_the_argv(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(INVENTORY.format(workdir=tmp_path / "w"))
    spec = load_inventory(path).targets["x"]
    assert spec.run.regen_servers == ("10.0.0.5:30000", "http://10.0.0.6:8000/v1")
    argv = runs.regen_argv(
        spec, "in put.jsonl", "out;rm -rf /.jsonl", spec.run.regen_servers, ["--max-tokens", "8"]
    )
    assert argv[1:] == [
        "-m", "training", "regen", "--input", "in put.jsonl", "--output", "out;rm -rf /.jsonl",
        "--server", "10.0.0.5:30000", "--server", "http://10.0.0.6:8000/v1", "--max-tokens", "8",
    ]  # fmt: skip


@pytest.mark.parametrize("bad", ['["a b"]', '"10.0.0.5:1"', "[1]"])
def test_bad_regen_servers_are_one_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "fleet.toml"
    text = INVENTORY.format(workdir=tmp_path / "w").replace(
        '["10.0.0.5:30000", "http://10.0.0.6:8000/v1"]', bad
    )
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"targets\.x\.run\.regen_servers must be a list of addresses"):
        load_inventory(path)


def test_regen_without_a_server_names_both_places(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(INVENTORY.format(workdir=tmp_path / "w").replace("regen_servers", "# regen_servers"))
    spec = load_inventory(path).targets["x"]
    with pytest.raises(
        ConfigError, match=r"give --server HOST:PORT or set \[targets\.x\.run\] regen_servers"
    ):
        runs.regen(Target(spec), "in.jsonl", "out.jsonl", [], [])
