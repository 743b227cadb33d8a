"""The one fan-out of fleet: the same work on several targets (or hosts of one run) at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fleet.errors import FleetError

Item = TypeVar("Item")
T = TypeVar("T")
MAX_PARALLEL = 16


def fan_out(
    items: Sequence[Item], work: Callable[[Item], T], *, limit: int = MAX_PARALLEL
) -> list[T | FleetError]:
    """``work`` on every item, one thread each (at most ``limit`` at once); results in ``items``'
    order, a ``FleetError`` in its item's place (any other exception propagates: a bug)."""

    def one(item: Item) -> T | FleetError:
        try:
            return work(item)
        except FleetError as err:
            return err

    if len(items) == 1:
        return [one(items[0])]
    with ThreadPoolExecutor(max_workers=max(1, min(limit, len(items)))) as pool:
        return list(pool.map(one, items))


def raise_first(outcomes: Sequence[T | FleetError]) -> list[T]:
    """The results of :func:`fan_out` when every item succeeded; else the first item's error."""
    for outcome in outcomes:
        if isinstance(outcome, FleetError):
            raise outcome
    return list(outcomes)  # type: ignore[arg-type]
