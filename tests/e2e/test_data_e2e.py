"""The user's own data through `fab`: a SpecForge-format file and a raw ShareGPT file, unchanged,
reported by `fab data` and trained by `fab deploy train` in the container (test host)."""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING, Any

import pytest
import testkit

if TYPE_CHECKING:
    from collections.abc import Iterator

    from testkit import RemoteFleet

pytestmark = [pytest.mark.hosts, pytest.mark.slow]

STEPS = 4
UV_CACHE = "/workspace/.fleet-test-uv-cache"  # shared with the other e2e suites (torch is large)
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


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def wait_final(fleet: RemoteFleet) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def final() -> bool:
        holder["st"] = json.loads(fleet.fab("status", "--json").stdout)
        return holder["st"]["state"] in ("finished", "stopped", "failed") and holder["st"]["alive"] is False

    testkit.wait_for("the run to end", final, timeout=600, interval=1.0)
    return holder["st"]


@pytest.fixture
def torch_fleet(remote_fleet: RemoteFleet) -> Iterator[RemoteFleet]:
    yield remote_fleet
    remote_fleet.fab("stop", "--force", timeout=120)
    remote_fleet.hosts.pct_exec("rm", "-rf", "--", f"{remote_fleet.workdir}/envs", check=False, timeout=900)


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
                f"--train.steps={STEPS}",
                "--eval.num_prompts=0",
                f"--data.path={data_dir}/{fmt}.jsonl",
            ]
            fleet.write(
                env="local-cpu", uv_cache=UV_CACHE, run={"config": "tiny-cpu", "overrides": overrides}
            )
            report = ok(fleet.fab("deploy", "data", timeout=1200)).stdout
            assert f"format {fmt}: 24 records, 24 kept" in report and "Batches per epoch:" in report, report
            ok(fleet.fab("train", "--no-warm", "--fresh", timeout=600))
            st = wait_final(fleet)
            assert (st["state"], st["step"]) == ("finished", STEPS), st
    finally:
        hosts.pct_exec("rm", "-rf", "--", data_dir, check=False)
