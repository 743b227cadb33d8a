"""How the suite is spread over pytest-xdist workers (tests/conftest.py, pyproject's addopts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import testkit

TOY = """
import json, os, pytest, time

LOG = os.environ["TOY_LOG"]

def note(what):
    with open(LOG, "a") as f:
        f.write(json.dumps([what, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.fixture(scope="module")
def built():
    note("fixture {mod}")
    return 1

def test_one(built):
    time.sleep(0.3)
    note("{mod}")

def test_two(built):
    time.sleep(0.3)
    note("{mod}")
"""


def test_a_module_runs_on_one_worker_with_its_fixtures_built_once(tmp_path: Path) -> None:
    """Under the addopts of pyproject.toml and this suite's conftest, with two workers: every test
    of a module on one worker, its module fixture built once (xdist's loadgroup lost this silently
    under pytest 9.2: pytest-dev/pytest-xdist#1386)."""
    toy = tmp_path / "toy"
    toy.mkdir()
    for mod in ("alpha", "beta", "gamma"):
        (toy / f"test_{mod}.py").write_text(TOY.format(mod=mod))
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "TOY_LOG": str(log), "PYTHONPATH": str(testkit.REPO / "tests")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(testkit.REPO / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "conftest",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-q",
            str(toy),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for mod in ("alpha", "beta", "gamma"):
        workers = {worker for what, worker in lines if what in (mod, f"fixture {mod}")}
        assert len(workers) == 1, (mod, lines)
        assert sum(what == f"fixture {mod}" for what, _ in lines) == 1, lines
    assert len({worker for _, worker in lines}) == 2, lines  # and the work is spread


def test_the_longest_modules_named_for_the_schedule_exist_and_go_first() -> None:
    """testkit.LONGEST_MODULES name real modules (a renamed one would silently lose its place),
    and a collection hands them out longest first, after the exclusive-host modules and the two
    long modules that go beside the first of them."""
    for module in testkit.LONGEST_MODULES:
        assert (testkit.REPO / module).is_file(), module
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
        cwd=testkit.REPO,
        env={**os.environ, "PYTEST_ADDOPTS": ""},  # the caller's -v would change the listing's form
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    order = list(dict.fromkeys(line.split("::")[0] for line in done.stdout.splitlines() if "::" in line))
    # The first exclusive-host module, beside it (the other of two workers) the two longest modules
    # that never take the test host's lock (the fresh machine's own container, the smol run), the
    # other exclusive-host module, then the rest of the longest, longest first.
    exclusive = ["tests/e2e/test_doctor_e2e.py", "tests/e2e/test_liveness_e2e.py"]
    beside = ["tests/e2e/test_fresh_machine.py", "tests/training/run/test_smol.py"]
    rest = [m for m in testkit.LONGEST_MODULES if m not in beside]
    assert order[: 4 + len(rest)] == [exclusive[0], *beside, exclusive[1], *rest], order[:8]
