"""Fixtures and hooks shared by every test tier; the helpers themselves live in tests/testkit.py.

Tests import helpers with `from testkit import ...` (a unique module name: `import conftest`
would be ambiguous, since tests/training has a conftest.py of its own).

The suite runs on several pytest-xdist workers (pyproject's addopts: `-n auto`, `--dist loadscope`):
- each test module is one unit of work (one worker runs all of it, in order, with its module
  fixtures built once; a test class is a unit of its own). Not ``loadgroup``: under the locked pytest (9.2)
  xdist's ``@group`` suffix on node ids is lost (pytest-dev/pytest-xdist#1386) and every test
  became a unit of its own (tests/test_suite_layout.py checks this);
- modules with an ``exclusive_host`` test are handed out first (nothing holds the test host yet),
  the first of them with two long modules that never take the host's lock beside it on each
  other worker; then the longest modules, longest first (``testkit.LONGEST_MODULES``), then modules with
  `slow` tests (the longest work starts early, none is left alone at the end);
- a test marked ``exclusive_host`` (it changes the test host's shared state: container 200's
  devices, /etc/hosts, mounts) runs while no other test uses the test host
  (``testkit.test_host_lock``); every other test that uses the host (the ``hosts`` fixture)
  holds it shared, except one marked ``own_container`` (it works in a container of its own).
At the end the session fails if a process it started is still alive (``testkit.leftovers``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest
import testkit
from testkit import hosts, llama_build, local_tmux, remote_fleet

from training.contract import DATA_CACHE_ENV

__all__ = ["hosts", "llama_build", "local_tmux", "remote_fleet"]

# This machine's image sets PYTHONDONTWRITEBYTECODE=1, and a venv uv installs has no bytecode: every
# Python the suite starts (trainers, torchrun ranks, `fab`) would compile torch's and transformers'
# ~2,800 modules from source again, ~8 s of CPU a trainer and ~0.5 s a `fab` call. The suite lets
# them write their bytecode once and read it after (xdist's workers inherit this environment).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The dev group's packages the trainer's tests import (pyproject.toml, [dependency-groups] train).
TRAINER_PACKAGES = {"torch", "transformers", "datasets", "tokenizers", "numpy", "safetensors", "gguf"}


_OWNS_MARKER = pytest.StashKey[bool]()
_OWN_CACHES = pytest.StashKey[list[str]]()
TRAINING_CACHE_ENV = "FLEET_TEST_TRAINING_CACHE"  # the test fixtures' FLEET_TRAINING_CACHE


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "exclusive_host: changes the test host's shared state; runs while no other test uses the host",
    )
    config.addinivalue_line(
        "markers", "own_container: uses the test host only through a container of its own"
    )
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        # A pytest run by a test (tests/hosts/test_fixtures.py) inherits the outer session's
        # marker: its leftovers would be the outer session's own workers, so only the session
        # that made the marker checks for them.
        config.stash[_OWNS_MARKER] = testkit.SESSION_ENV not in os.environ
        testkit.start_session_marker()
        # One tokenized-data cache for the session's trainers (xdist's workers and every process
        # they start inherit it): most runs train the same few data sets, and tokenizing one is
        # ~4 s of a tiny run's ~13 s. The cache is keyed by the data's bytes, the tokenizer and
        # max_length (training.data.dataset.content_key) and written aside and renamed, so runs
        # of other data never read it and runs at once share it safely, as a workdir's runs do.
        # The same for the trainer's model cache (the tiny model, SmolLM2's GGUF converted, the
        # targets' regenerated sets), read by the fixtures that name FLEET_TEST_TRAINING_CACHE:
        # built once a session, not once a worker or a module. Also keyed by what they hold
        # (model, prompts, settings) and written aside and renamed.
        owned = []
        for name, prefix in ((DATA_CACHE_ENV, "data"), (TRAINING_CACHE_ENV, "training")):
            if name not in os.environ:
                os.environ[name] = tempfile.mkdtemp(prefix=f"fleet-suite-{prefix}-cache-")
                owned.append(os.environ[name])
        config.stash[_OWN_CACHES] = owned


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `--no-loadscope-reorder`: xdist hands out modules in this order
    slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
    # Modules with an exclusive_host test go first, while nothing else holds the test host. Two of
    # them on two workers at once wait on each other test by test (22 s of a CI run's worker time),
    # so the first has beside it, on each other worker, long modules that never take the test
    # host's lock; the others follow it. Two of those a worker: xdist queues a worker's next module
    # while at most two of its tests are pending (LoadScopeScheduling._reschedule), so the
    # fresh-machine module (one test) gets the module after it queued on the same worker at once,
    # and that must not be an exclusive one (it would wait ~3 min, then for the host's other users).
    marked = (_module(item) for item in items if item.get_closest_marker("exclusive_host"))
    exclusive = list(dict.fromkeys(marked))
    on_host = {_module(item) for item in items if _takes_the_host(item)}
    workers = getattr(config, "workerinput", {}).get("workercount", 2)
    modules = {_module(item) for item in items}
    longest = [m for m in testkit.LONGEST_MODULES if m in modules]
    beside = [m for m in longest if m not in on_host][: 2 * max(1, workers - 1)] if exclusive else []

    # Then the longest modules, longest first: one started last would leave the other worker idle
    # to the end (a 4-minute tail in a CI run); then the other slow ones; file order otherwise.
    def rank(item: pytest.Item) -> tuple[int, int, bool]:
        module = _module(item)
        if exclusive and module == exclusive[0]:
            return 0, 0, False
        if module in beside:
            return 1, beside.index(module), False
        if module in exclusive:
            return 2, exclusive.index(module), False
        position = longest.index(module) if module in longest else len(longest)
        return 3, position, module not in slow_modules

    items.sort(key=rank)  # stable


def _takes_the_host(item: pytest.Item) -> bool:
    """Whether the test holds the test host's lock (``_test_host_access``)."""
    if item.get_closest_marker("exclusive_host"):
        return True
    return not item.get_closest_marker("own_container") and "hosts" in getattr(item, "fixturenames", ())


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A test module that cannot import the trainer's packages (torch, ...: a machine without
    `./bootstrap --dev`'s dev group) is skipped with that reason, not a collection error."""
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        missing = re.search(r"No module named '([\w.]+)'", str(report.longrepr))
        if missing and missing.group(1).split(".")[0] in TRAINER_PACKAGES:
            report.outcome = "skipped"
            report.longrepr = (
                str(collector.path),
                None,
                f"Skipped: needs {missing.group(1)}, which is not installed here (./bootstrap --dev)",
            )
    return report


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per CPU, at most 4. More workers than CPUs starve the CPU-bound
    trainer tests (each a torch process or a torchrun group) far past their timeouts."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(autouse=True)
def _test_host_access(request: pytest.FixtureRequest) -> Iterator[None]:
    """Shared use of the test host for a test that uses it; sole use for an ``exclusive_host`` one."""
    exclusive = request.node.get_closest_marker("exclusive_host") is not None
    own = request.node.get_closest_marker("own_container") is not None
    if not exclusive and (own or "hosts" not in request.fixturenames):
        yield
        return
    with testkit.test_host_lock(exclusive=exclusive):
        yield


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        testkit.note_container_processes()


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after xdist's teardown and the summary
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """After everything else (xdist's workers are gone): fail the session on a process left behind."""
    result = yield
    if hasattr(session.config, "workerinput"):
        return result
    for cache in session.config.stash.get(_OWN_CACHES, []):
        shutil.rmtree(cache, ignore_errors=True)
    if not session.config.stash.get(_OWNS_MARKER, False):
        return result
    left = testkit.leftovers()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"  {p.text()}" for p in left]
        lines.append(f"FAILED: {len(left)} process(es) started by the tests outlived them (killed now)")
        for line in lines:
            if reporter is not None:
                reporter.write_line(line, red=True)
            else:
                print(line)
        testkit.kill(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result
