"""The one exception tree of fleet.

Every failure a user can cause or meet is one of these, raised deep inside and
caught once, at the task boundary (``fleet.cli.fleet_task``), where it becomes
one line on stderr and an exit code. Nothing else is caught there: a bug still
shows its traceback.

    FleetError                   exit 1  anything fleet refuses or cannot do
    ├── ConfigError              exit 2  inventory, run config or task arguments are wrong
    ├── TargetError              exit 3  a target cannot be reached or used
    │   └── CommandFailed        exit 3  a command on a target exited non-zero
    │       └── DiskFull         exit 3  ... because the target's disk is full
    ├── DeployError              exit 4  a release could not be put in place
    ├── RunError                 exit 5  no run / a run is already live / stop failed
    ├── EnvError                 exit 6  an environment is missing, drifted or failed to build
    └── GpuGateError             exit 7  the GPUs are not clean (names the PIDs)

Messages are one line: what is wrong, where (which key, target, path), what to do.
"""

from __future__ import annotations

from collections.abc import Sequence


class FleetError(Exception):
    """Base of every error fleet reports to a user."""

    exit_code = 1


class ConfigError(FleetError):
    """The inventory, a run config or a task argument is invalid."""

    exit_code = 2


class TargetError(FleetError):
    """A target could not be reached or used (unreachable, auth, container down)."""

    exit_code = 3


class CommandFailed(TargetError):
    """A command on a target exited non-zero; carries what is needed to understand why."""

    def __init__(
        self,
        target: str,
        argv: Sequence[str],
        exit_code: int,
        stderr: str,
        hint: str = "",
    ) -> None:
        self.target = target
        self.argv = tuple(argv)
        self.command_exit_code = exit_code
        self.stderr_tail = tail_lines(stderr, 5)
        self.hint = hint
        shown = " ".join(self.argv)
        if len(shown) > 160:
            shown = shown[:157] + "..."
        message = f"{target}: `{shown}` exited {exit_code}"
        if self.stderr_tail:
            message += f": {self.stderr_tail}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


class DiskFull(CommandFailed):
    """A command on a target failed because its disk is full (ENOSPC): the cause, then the command."""

    def __init__(self, target: str, argv: Sequence[str], exit_code: int, stderr: str, where: str, path: str):
        super().__init__(target, argv, exit_code, stderr)
        shown = " ".join(self.argv)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        self.args = (
            f"{target}: no space left on device on {where} (`{shown}` exited {exit_code}: "
            f"{tail_lines(stderr, 2)}); free space there (`df -h {path}`) and retry",
        )


class DeployError(FleetError):
    """A release could not be uploaded or switched; the previous one stays current."""

    exit_code = 4


class RunError(FleetError):
    """Starting, stopping or finding a run failed."""

    exit_code = 5


class EnvError(FleetError):
    """An environment is missing, drifted, or could not be built or verified."""

    exit_code = 6


class GpuGateError(FleetError):
    """The GPUs of a target are not clean enough to launch on."""

    exit_code = 7


def tail_lines(text: str, count: int) -> str:
    """The last ``count`` non-empty lines of ``text``, joined with `` | `` to stay one line."""
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return " | ".join(lines[-count:])
