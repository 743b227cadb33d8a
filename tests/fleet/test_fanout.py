"""The one fan-out: results in order, a FleetError in its item's place, threads at once."""

from __future__ import annotations

import threading

import pytest

from fleet.errors import FleetError, RunError
from fleet.fanout import fan_out, raise_first


def test_results_in_order_and_errors_in_place() -> None:
    def work(n: int) -> int:
        if n == 2:
            raise RunError("two failed")
        return n * 10

    outcomes = fan_out([1, 2, 3], work)
    assert outcomes[0] == 10 and outcomes[2] == 30
    assert isinstance(outcomes[1], RunError) and str(outcomes[1]) == "two failed"
    with pytest.raises(FleetError, match="two failed"):
        raise_first(outcomes)
    assert raise_first(fan_out([1, 3], work)) == [10, 30]


def test_items_run_at_once() -> None:
    # each item waits for all of them: only concurrent work passes the barrier (else it times out)
    barrier = threading.Barrier(3, timeout=30)
    assert fan_out(["a", "b", "c"], lambda s: (barrier.wait(), s)[1]) == ["a", "b", "c"]


def test_a_bug_is_not_swallowed() -> None:
    with pytest.raises(ZeroDivisionError):
        fan_out([1, 0], lambda n: 1 // n)
