"""The task boundary: ``fleet_task`` (errors -> one line + exit code) and target selection.

Every Fabric task in ``tasks.py`` is a ``@fleet_task``. Inside, a task picks its targets with
:func:`single_target` (tasks that change a target) or :func:`on_targets` / :func:`map_targets`
(read-only tasks, which also accept ``FLEET_TARGET=all`` and then run on every target in
parallel, one ``Target`` per thread: printed grouped by target, or returned in inventory order).
A ``FleetError`` raised anywhere below is caught here, once, and printed as
``fleet: <target>: <message>`` on stderr; the exit code is the error's. A reader that closes
the output early (``fab stop | head``) ends the task quietly with exit 141, as SIGPIPE would.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from invoke import Context, task
from invoke.exceptions import Exit

from fleet.errors import ConfigError, FleetError
from fleet.fanout import fan_out
from fleet.inventory import (
    REPO_ROOT,
    Inventory,
    MultiRunSpec,
    TargetSpec,
    load_inventory,
    select_run,
    select_targets,
)
from fleet.target import Target, open_target
from training.contract import TARGET_ENV

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def repo_root() -> Path:
    """The directory of ``tasks.py``: what ``fab deploy`` ships code from."""
    return REPO_ROOT


def inventory() -> Inventory:
    """The inventory: ``$FLEET_CONFIG``, else ``fleet.toml`` next to ``tasks.py``."""
    return load_inventory()


def selected_run() -> MultiRunSpec | None:
    """The run over several hosts that ``FLEET_TARGET`` names (``[runs.NAME]``), else None."""
    return select_run(inventory())


def targets_for(ctx: Context | None, read_only: bool) -> list[TargetSpec]:
    """The targets ``FLEET_TARGET`` selects (default: the inventory's ``default_target``).

    ``all`` is accepted only when ``read_only``. The whole inventory is validated first.
    """
    return select_targets(inventory(), allow_all=read_only)


def error_line(err: FleetError, target: str | None = None) -> str:
    """``fleet: <target>: <message>`` on one line (the target is not repeated if already there)."""
    message = " ".join(str(err).split()) or type(err).__name__
    target = target or getattr(err, "fleet_target", None)
    if target and not message.startswith(f"{target}:"):
        message = f"{target}: {message}"
    return f"fleet: {message}"


def _tag(err: FleetError, target: str) -> None:
    if getattr(err, "fleet_target", None) is None:
        err.fleet_target = target  # type: ignore[attr-defined]


def fleet_task(*args: Any, **kwargs: Any) -> Any:
    """``@fleet_task`` / ``@fleet_task(help={...})``: an invoke task whose ``FleetError`` is one line.

    The wrapped task prints ``fleet: <target>: <message>`` to stderr (no traceback) and exits with
    ``err.exit_code`` through ``invoke.exceptions.Exit``.
    """

    def decorate(func: F) -> Any:
        @functools.wraps(func)
        def wrapper(ctx: Context, *a: Any, **kw: Any) -> Any:
            try:
                result = func(ctx, *a, **kw)
                sys.stdout.flush()  # here, not at interpreter exit, so a closed pipe is caught below
                return result
            except FleetError as err:
                with contextlib.suppress(BrokenPipeError):
                    sys.stdout.flush()
                print(error_line(err), file=sys.stderr, flush=True)
                raise Exit(code=err.exit_code) from None
            except BrokenPipeError:
                # The reader went away (`fab stop | head`): what the task did stands; nothing
                # more to say. Output goes nowhere from now on, so Python's exit flush cannot fail.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise Exit(code=BROKEN_PIPE_EXIT) from None

        return task(**kwargs)(wrapper)

    if len(args) == 1 and callable(args[0]) and not kwargs:
        return decorate(args[0])
    if args:
        raise TypeError("fleet_task takes keyword arguments only (those of invoke.task)")
    return decorate


@contextmanager
def single_target(ctx: Context | None = None) -> Iterator[Target]:
    """The one selected target, opened (one connection for the whole task) and closed after."""
    (spec,) = targets_for(ctx, read_only=False)
    with _opened(spec) as target:
        yield target


def map_targets(
    ctx: Context | None,
    work: Callable[[Target], T],
    *,
    read_only: bool = True,
    allow_many: bool = True,
    why_one: str = "this task needs one target",
) -> list[tuple[str, T | FleetError]]:
    """``work`` on each selected target: [(target name, what it returned or the FleetError it raised)].

    One target: in this thread, and its ``FleetError`` propagates (the task boundary prints it).
    Several (``FLEET_TARGET=all``, only when ``allow_many``): one thread and one ``Target`` per
    target, at most ``MAX_PARALLEL`` at once; results in inventory order, a failure in its place.
    """
    return [(spec.name, outcome) for spec, outcome in _fan_out(ctx, work, read_only, allow_many, why_one)]


def on_targets(
    ctx: Context | None,
    work: Callable[[Target], str | None],
    *,
    read_only: bool = True,
    allow_many: bool = True,
) -> None:
    """Run ``work`` on each selected target (:func:`map_targets`) and print what it returns.

    One target: output printed as is. Several: each target's output is printed as a block under
    ``== name ==``, in inventory order, and every failure as its own ``fleet: <target>: ...`` line.
    The task then fails with the exit code of the first failed target.
    """
    outcomes = _fan_out(ctx, work, read_only, allow_many, "this task needs one target")
    if len(outcomes) == 1:
        text = outcomes[0][1]
        if text and not isinstance(text, FleetError):
            print(text.rstrip("\n"), flush=True)
        return
    for spec, text in outcomes:
        print(f"== {spec.name} ({spec.display}) ==")
        if text and not isinstance(text, FleetError):
            print(text.rstrip("\n"))
    sys.stdout.flush()
    failed = [(spec, err) for spec, err in outcomes if isinstance(err, FleetError)]
    for spec, err in failed:
        print(error_line(err, spec.name), file=sys.stderr, flush=True)
    if failed:
        raise Exit(code=failed[0][1].exit_code)


def _fan_out(
    ctx: Context | None, work: Callable[[Target], T], read_only: bool, allow_many: bool, why_one: str
) -> list[tuple[TargetSpec, T | FleetError]]:
    """The one fan-out of fleet (see :func:`map_targets`)."""
    specs = targets_for(ctx, read_only=read_only)
    if len(specs) == 1:
        with _opened(specs[0]) as target:
            return [(specs[0], work(target))]
    if not allow_many:
        raise ConfigError(f"{why_one}; set {TARGET_ENV} to one name, not all")

    def one(spec: TargetSpec) -> T:
        with _opened(spec) as target:
            return work(target)

    return list(zip(specs, fan_out(specs, one), strict=True))


@contextmanager
def _opened(spec: TargetSpec) -> Iterator[Target]:
    target = open_target(spec)
    try:
        yield target
    except FleetError as err:
        _tag(err, spec.name)
        raise
    finally:
        target.close()
