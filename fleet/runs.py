"""Runs in tmux: start, stop, basic status and logs of a target's one run (session ``fleet-run``).

Each operation is one or two commands on the target, each a fixed script from ``fleet/remote/``
run as ``sh -c <script> <name> <args...>`` (arguments positional, never interpolated):

- ``start_run``: ``run_state.sh`` (is a run live? which release is current? the latest run id),
  then ``run_launch.sh``: run dir, ``run.json``, ``runs/latest``, and the tmux session whose pane
  runs the release's ``remote/run.sh`` (pid/pgid files, tee to ``train.log``, ``exit_code``).
- ``stop_run``: ``run_stop.sh`` signals the process group run.sh recorded, only while it is the
  live pane's process, and waits a bounded time; then one status read.
- ``basic_status``: ``run_state.sh`` once; :func:`parse_state` (pure) turns its output into data.

Secrets (``run.env`` values) travel on the launcher's stdin into ``<run-dir>/run.env`` (mode 0600),
which run.sh sources and deletes before the trainer starts. They are never in argv (``ps``), in
tmux's environment (``tmux show-environment``), in ``run.json`` or in the log. The run's cwd and
``PYTHONPATH`` are the release directory ``current`` resolved to at start, so a later deploy never
changes the code under a live run (and deploy never prunes that release).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fleet import compile_share, remote, trainer_cli
from fleet.deploy import RELEASE_ID_RE, release_id_from_link
from fleet.errors import CommandFailed, ConfigError, RunError, TargetError, tail_lines
from fleet.inventory import ENV_KEY_RE, MultiRunSpec, TargetSpec
from fleet.layout import RUN_SESSION
from fleet.status.diagnose import NOT_RETRYABLE, find_traceback
from fleet.status.model import State
from fleet.target import CommandResult, Target, scrub
from training import contract

RunState = Literal["live", "exited", "never"]
RUN_ID_RE = re.compile(r"^(\d{8}T\d{6}Z)-([A-Za-z0-9_.-]+)$")
TIME_FORMAT = "%Y%m%dT%H%M%SZ"
EXIT_LIVE = 75  # run_launch.sh: a run is live
EXIT_NO_WRAPPER = 66  # run_launch.sh: the release lacks remote/run.sh
EXIT_EXISTS = 73  # run_launch.sh: the run directory exists
EXIT_SHORT_ENV = 74  # run_launch.sh: the environment file arrived incomplete
STATUS_LINES = 12


@dataclass(frozen=True)
class RunInfo:
    """A run just started: what ``run.json`` records."""

    run_id: str
    release_id: str
    run_dir: str
    argv: tuple[str, ...]
    started_at: str
    target: str
    resumed_from: int | None = None  # the checkpoint's step when this launch resumes the run
    checkpoint: str = ""  # ... and its path


@dataclass(frozen=True)
class Resume:
    """A stopped or failed run that ``fab train`` continues: its newest checkpoint."""

    run_id: str
    step: int
    total_steps: int
    checkpoint: str


@dataclass(frozen=True)
class LaunchPlan:
    """What ``fab train`` will launch, decided before the GPU gate and the warm-up."""

    release_id: str | None  # None: nothing deployed (start_run refuses)
    latest: str | None  # runs/latest's run id (a new run id is bumped past it)
    resume: Resume | None = None
    note: str = ""  # why a new run although one could have been continued (finished, no checkpoint)
    rejected: tuple[str, ...] = ()  # newer checkpoints that failed their check: one line each


@dataclass(frozen=True)
class BasicStatus:
    """A target's run at a glance: live / exited (with code) / never started."""

    target: str
    state: RunState
    run_id: str | None = None
    release_id: str | None = None
    exit_code: int | None = None
    last_lines: tuple[str, ...] = ()
    current_release: str | None = None
    started_at: str | None = None
    message: str = ""  # what an action did (stop_run), empty for a plain status read
    # The tmux session is per container (one tmux server), the workdir is per target: a live pane
    # whose pid is not this workdir's recorded pgid belongs to another workdir (or to no fleet run).
    foreign_pid: int | None = None

    def text(self) -> str:
        """Human lines: a headline, the message, then the last log lines indented."""
        if self.foreign_pid is not None:
            head = (
                f"{self.target}: tmux session {RUN_SESSION} runs a process that is not this workdir's "
                f"run (pane pid {self.foreign_pid}); inspect it with `tmux attach -t {RUN_SESSION}`"
            )
        elif self.state == "never":
            head = f"{self.target}: no run started yet (`fab train` starts one)"
        elif self.state == "live":
            head = f"{self.target}: run {self.run_id or '?'} is live (release {self.release_id or '?'})"
        else:
            code = "unknown" if self.exit_code is None else str(self.exit_code)
            head = (
                f"{self.target}: run {self.run_id or '?'} exited with code {code} "
                f"(release {self.release_id or '?'})"
            )
        lines = [head]
        if self.message:
            lines.append(f"  {self.message}")
        lines.extend(f"  | {line}" for line in self.last_lines)
        return "\n".join(lines)

    def to_json(self) -> str:
        data = asdict(self)
        data["last_lines"] = list(self.last_lines)
        return json.dumps(data, sort_keys=True)


# --- pure helpers -----------------------------------------------------------------------------------


def make_run_id(now: dt.datetime, config: str, latest: str | None = None) -> str:
    """``YYYYmmddTHHMMSSZ-<config>`` (a config path becomes its file stem), bumped past ``latest``."""
    name = PurePosixPath(config).stem if ("/" in config or config.endswith(".toml")) else config
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "run"
    stamp = now.astimezone(dt.UTC).replace(microsecond=0, tzinfo=None)
    m = RUN_ID_RE.match(latest or "")
    if m:
        newest = dt.datetime.strptime(m.group(1), TIME_FORMAT)
        if stamp <= newest:
            stamp = newest + dt.timedelta(seconds=1)
    return f"{stamp.strftime(TIME_FORMAT)}-{name}"


@dataclass(frozen=True)
class NodeLaunch:
    """Host ``index`` of a run over several hosts: one torchrun agent with ``--nnodes``,
    ``--node-rank`` and the c10d rendezvous, started by :func:`fleet.multihost.train`."""

    run: MultiRunSpec
    index: int

    def argv(self, spec: TargetSpec, run_dir: str, run_id: str) -> list[str]:
        """This host's torchrun agent of the run (:func:`fleet.trainer_cli.node_train`)."""
        return trainer_cli.node_train(spec, self.run, self.index, run_dir, run_id)

    def env(self, spec: TargetSpec) -> dict[str, str]:
        """What this host's ranks need besides the run's environment: the target's name (errors
        name a lost peer by it) and the network interface hints."""
        node = self.run.nodes[self.index]
        env = {contract.NODE_NAME_ENV: spec.name}
        if node.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = node.socket_ifname
            env["GLOO_SOCKET_IFNAME"] = node.socket_ifname
        return env

    def record(self) -> dict[str, Any]:
        """``run.json``'s ``multi_host``: the run, the hosts in rank order, this host's place."""
        run = self.run
        return {
            "run": run.name,
            "targets": list(run.targets),
            "node_rank": self.index,
            "topology": str(run.topology),
            "first_rank": run.first_rank(self.index),
            "placement": run.placement,
            "nproc": run.nodes[self.index].nproc,
            "checkpoint_host": run.targets[run.checkpoint_node],
        }


def run_env(spec: TargetSpec) -> dict[str, str]:
    """The run's environment: the compile-cache and data-cache roots, then ``run.env`` (which may
    override them)."""
    layout = spec.layout
    return {
        contract.COMPILE_CACHE_ENV: layout.compile_cache,
        contract.DATA_CACHE_ENV: layout.data_cache,
        **spec.run.env,
    }


def wrapper_env(spec: TargetSpec) -> dict[str, str]:
    """What the run's wrapper (``remote/run.sh``) reads and unsets before the trainer starts: the
    restart policy and the causes it never retries (``fleet.status.diagnose.NOT_RETRYABLE``)."""
    env: dict[str, str] = {}
    if spec.run.restart_max > 0:
        env[contract.RESTART_MAX_ENV] = str(spec.run.restart_max)
        env[contract.RESTART_BACKOFF_ENV] = str(max(1, math.ceil(spec.run.restart_backoff_s)))
        env[contract.NO_RETRY_ENV] = "\n".join(f"{sig}\t{needle}" for sig, needle in NOT_RETRYABLE)
    notify = spec.notify
    if notify.enabled:  # the notifier's (remote/run_notify.py); the URL and headers may be secrets
        env[contract.NOTIFY_URL_ENV] = notify.url
        env[contract.NOTIFY_HEADERS_ENV] = json.dumps(dict(notify.headers))
        env[contract.NOTIFY_COMMAND_ENV] = json.dumps(list(notify.command))
        env[contract.NOTIFY_PASS_ENV] = " ".join(notify.command_env)
        env[contract.NOTIFY_TARGET_ENV] = spec.name
        env[contract.NOTIFY_STALL_ENV] = str(spec.stall_window_s)
    return env


def run_with_env(
    target: Target,
    argv: Sequence[str],
    *,
    stream: bool = False,
    in_current: bool = True,
    timeout: float | None = None,
) -> CommandResult:
    """Run ``argv`` with the run's environment (``run_env``), as every task that needs it does
    (``fab warm``, ``fab plan``, ``fab doctor --bandwidth``, ...): the values go on stdin to
    ``remote/with_env.sh``, never into argv (``ps`` on the host and in the container), a file or
    an error message. In ``<workdir>/current`` unless not ``in_current`` (nothing deployed yet);
    ``stream`` shows the output as it comes. Never raises on a non-zero exit."""
    spec = target.spec
    env = run_env(spec)
    where = spec.layout.current if in_current else None
    run = target.run_stream if stream else target.run
    argv = [str(a) for a in argv]
    res = run(
        remote.sh("with_env.sh", *argv), cwd=where, check=False, stdin=env_file_text(env), timeout=timeout
    )
    return replace(res, argv=tuple(argv), stderr=scrub(res.stderr, env))


def failure_summary(output: str, exit_code: int) -> str:
    """One line saying why a trainer command failed: its own ``... failed: ...`` summary line, else
    the exception of its last traceback, else its last lines."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("warm: failed")]
    if own:
        return own[-1]
    tb = find_traceback(output)
    if tb is not None:
        return f"{tb.exception} (at {tb.file}:{tb.line})"
    return tail_lines(output, 3) or f"exit {exit_code}"


def warm_cache(target: Target, *, if_needed: bool, store: Path | None = None) -> bool:
    """``fab warm`` (and ``fab train`` unless --no-warm): compile the run config's shapes into the
    target's compile cache, in ``<workdir>/current``, output streamed. Skipped (False) when the run
    module is not the bundled trainer. The run's env arrives on stdin as for a run (never in argv).
    ``store``: the controller's compile artefacts (``fleet.compile_share``), pushed to the target
    first (a key another host warmed is then warm here) and pulled back after."""
    spec = target.spec
    if spec.run.module != "training":
        return False
    root = spec.layout.compile_cache
    if store is not None:
        for key in compile_share.push(target, store, root):
            print(f"{target.name}: compile cache {key} shipped from the controller", flush=True)
    res = run_with_env(target, trainer_cli.warm(spec, if_needed=if_needed), stream=True)
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: compile-cache warm-up failed ({failure_summary(res.stderr, res.exit_code)}); "
            "fix it (`fab deploy` if nothing is deployed) or start without it: `fab train --no-warm`"
        )
    if store is not None:
        for key in compile_share.pull(target, store, root):
            print(f"{target.name}: compile cache {key} kept on the controller ({store / key})", flush=True)
    return True


def plan(target: Target, gpus: int, *, as_json: bool) -> str:
    """``fab plan``: the split advisor's output, run on the target with the run's environment."""
    res = run_with_env(target, trainer_cli.plan(target.spec, gpus, as_json=as_json))
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: `{target.spec.run.module} plan` failed "
            f"({failure_summary(res.stderr or res.stdout, res.exit_code)}); `fab deploy` first if "
            "nothing is deployed"
        )
    return res.stdout.rstrip("\n")


def data_report(target: Target, *, as_json: bool) -> str:
    """``fab data``: the run config's data report (``python -m training data``), on the target."""
    spec = target.spec
    argv = [spec.run_python, "-m", spec.run.module, "data", "--config", spec.run.config, *spec.run.overrides]
    res = run_with_env(target, [*argv, *(["--json"] if as_json else [])])
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: `{spec.run.module} data` failed "
            f"({failure_summary(res.stderr or res.stdout, res.exit_code)}); `fab deploy` first if "
            "nothing is deployed"
        )
    return res.stdout.rstrip("\n")


def regen_argv(
    spec: TargetSpec, input_path: str, output: str, servers: Sequence[str], options: Sequence[str]
) -> list[str]:
    """``<python> -m <module> regen --input I --output O --server S ... <options>`` (paths as the
    target sees them; relative ones are under the deployed release's folder)."""
    argv = [spec.run_python, "-m", spec.run.module, "regen", "--input", input_path, "--output", output]
    for server in servers:
        argv += ["--server", server]
    return [*argv, *options]


def regen(
    target: Target, input_path: str, output: str, servers: Sequence[str], options: Sequence[str]
) -> None:
    """``fab regen``: regeneration through the servers, run on the target next to the data, its
    progress streamed; resumable (the trainer's ``regen`` keeps a ledger of done ids)."""
    spec = target.spec
    servers = list(servers) or list(spec.run.regen_servers)
    if not servers:
        raise ConfigError(
            f"{target.name}: no regeneration server: give --server HOST:PORT or set "
            f"[targets.{target.name}.run] regen_servers in the inventory"
        )
    res = run_with_env(target, regen_argv(spec, input_path, output, servers, options), stream=True)
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: `{spec.run.module} regen` ended with exit {res.exit_code} "
            f"({failure_summary(res.stderr or res.stdout, res.exit_code)}); the done records are kept: "
            "run `fab regen` again to resume (--retry-errors sends the failed ones again)"
        )


def env_file_text(env: Mapping[str, str]) -> bytes:
    """``export K='v'`` lines for run.sh to source; keys checked, values quoted for sh. The last
    line, ``# fleet-env-bytes N`` (N: the bytes before it), lets run_launch.sh refuse a file cut
    short by a dropped connection."""
    lines = []
    for key, value in sorted(env.items()):
        if not ENV_KEY_RE.match(key):
            raise RunError(
                f"the run's environment: {key!r} is not a variable name; use [A-Za-z_][A-Za-z0-9_]*"
            )
        lines.append(f"export {key}={shlex.quote(value)}\n")
    body = "".join(lines).encode()
    return body + f"# {contract.RUN_ENV_TRAILER} {len(body)}\n".encode()


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def parse_state(target: str, text: str) -> BasicStatus:
    """Parse ``run_state.sh`` output (pure): pane, current, latest, run_json, exit_code, pgid, log."""
    parts = remote.parse_answers(text)

    def sec(name: str) -> str:
        return remote.ok_output(parts, name)

    panes = [line.split(" ") for line in sec("pane").splitlines() if line.strip()]
    live = any(p[0] == "0" for p in panes)
    pane_pid = _int_or_none(panes[0][1]) if panes and len(panes[0]) > 1 else None
    pgid = _int_or_none(sec("pgid"))
    no_run_here = not sec("run_json").strip() and not sec("latest").strip()
    # The run's own lock decides (tmux may be gone while its trainer runs on); the pane tells
    # another workdir's run apart, and gives the exit status when run.sh could not write it.
    run_alive = sec("alive").strip() == "1"
    foreign = (
        live
        and not run_alive
        and (no_run_here or (pgid is not None and pane_pid is not None and pgid != pane_pid))
    )
    run: dict[str, Any] = {}
    if sec("run_json").strip():
        try:
            loaded = json.loads(sec("run_json"))
        except json.JSONDecodeError:
            loaded = {}
        run = loaded if isinstance(loaded, dict) else {}
    run_id = run.get("run_id") or (sec("latest").strip() or None)
    log = sec("log")
    last_lines = tuple(log.rstrip("\n").split("\n")) if log.strip() else ()
    exit_code = _int_or_none(sec("exit_code"))
    if exit_code is None and panes and not live and not run_alive:
        fields = panes[0] + ["", "", ""]
        status, signal = _int_or_none(fields[2]), _int_or_none(fields[3])
        exit_code = status if status is not None else (128 + signal if signal else None)
    state: RunState
    if foreign:
        return BasicStatus(
            target=target,
            state="live",
            last_lines=(),
            current_release=release_id_from_link(sec("current").strip()),
            foreign_pid=pane_pid,
        )
    if run_alive or (live and exit_code is None):
        state = "live"
    elif run or sec("latest").strip():
        state = "exited"
    else:
        state = "live" if live else "never"
    return BasicStatus(
        target=target,
        state=state,
        run_id=run_id if isinstance(run_id, str) else None,
        release_id=run.get("release") if isinstance(run.get("release"), str) else None,
        exit_code=exit_code if state == "exited" else None,
        last_lines=last_lines,
        current_release=release_id_from_link(sec("current").strip()),
        started_at=run.get("started_at") if isinstance(run.get("started_at"), str) else None,
    )


# --- remote operations ------------------------------------------------------------------------------


def _state(target: Target, lines: int) -> BasicStatus:
    spec = target.spec
    args = [spec.workdir, spec.commands.tmux, RUN_SESSION, str(max(int(lines), 0))]
    result = target.run(remote.sh("run_state.sh", *args), timeout=60)
    return parse_state(target.name, result.stdout)


def basic_status(target: Target, lines: int = STATUS_LINES) -> BasicStatus:
    """The target's run state and the last ``lines`` log lines, in one command."""
    return _state(target, lines)


def _live_error(target: Target, status: BasicStatus) -> RunError:
    if status.foreign_pid is not None:
        return RunError(
            f"{target.name}: tmux session {RUN_SESSION} on {target.spec.display} holds a live process that "
            f"is not a run of workdir {target.spec.workdir} (pane pid {status.foreign_pid}); one run per "
            f"container: stop it where it was started, or inspect it with `tmux attach -t {RUN_SESSION}`"
        )
    return RunError(
        f"{target.name}: run {status.run_id or '(unknown)'} is live in tmux session {RUN_SESSION}; "
        "stop it first with `fab stop` (or wait for it to finish)"
    )


def parse_resume_check(run_id: str, stdout: str) -> Resume | None:
    """``training resume-check``'s answer (``contract.parse_resume_line``) -> Resume; none -> None.
    The ``rejected`` lines before it: ``contract.parse_rejected_lines``."""
    try:
        point = contract.parse_resume_line(stdout)
    except ValueError:
        raise RunError(
            f"unexpected answer from `training resume-check`: {stdout[-200:]!r}; redeploy (`fab deploy`)"
        ) from None
    return None if point is None else Resume(run_id, point.step, point.total_steps, point.path)


def plan_launch(
    target: Target, release_id: str | None = None, *, fresh: bool = False, from_run: str = ""
) -> LaunchPlan:
    """Decide what ``fab train`` launches, before anything costly: refuse a live run; else continue
    the latest run (or ``from_run``) from its newest checkpoint when it stopped or failed with one
    and its model/drafter/data settings are unchanged (refused in one line naming the keys), else
    a new run. Resuming needs the bundled trainer (``run.module = "training"``); ``fresh`` always
    starts a new run."""
    spec = target.spec
    if fresh and from_run:
        raise ConfigError("train: give --fresh or --from RUN_ID, not both")
    if from_run and (not RUN_ID_RE.match(from_run) or from_run == "latest"):
        raise ConfigError(
            f"train --from {from_run!r}: not a run id (YYYYmmddTHHMMSSZ-name); `fab runs` lists them"
        )
    status = _state(target, 0)
    if status.state == "live":
        raise _live_error(target, status)
    release_id = release_id or status.current_release
    plan = LaunchPlan(release_id=release_id, latest=status.run_id)
    candidate = from_run or ("" if fresh else (status.run_id or ""))
    if not candidate or release_id is None:  # nothing deployed: start_run says so (after the GPU gate)
        return plan
    if spec.run.module != "training":
        if from_run:
            raise ConfigError(
                f'train --from {from_run}: resuming needs the bundled trainer (run.module = "training"), '
                f"not {spec.run.module!r}"
            )
        return plan
    res = run_with_env(target, trainer_cli.resume_check(spec, spec.layout.run_dir(candidate)))
    if res.exit_code == 2:
        why = tail_lines(res.stderr, 1).removeprefix("error: ") or "its settings changed"
        raise ConfigError(
            f"{target.name}: run {candidate} cannot resume: {why}; put them back, or "
            "`fab train --fresh` starts a new run"
        )
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: could not check whether run {candidate} can resume "
            f"({failure_summary(res.stderr or res.stdout, res.exit_code)}); "
            "`fab train --fresh` starts a new run"
        )
    resume = parse_resume_check(candidate, res.stdout)
    plan = replace(plan, rejected=contract.parse_rejected_lines(res.stdout))
    if resume is None:
        if from_run:
            raise RunError(
                f"{target.name}: run {from_run} has no checkpoint to resume from "
                f"({spec.layout.run_dir(from_run)}/{contract.CHECKPOINT_DIR}); `fab runs` lists runs"
            )
        none = "no checkpoint that passed its check" if plan.rejected else "no checkpoint"
        return replace(plan, note=f"run {candidate} has {none}: starting a new run")
    if resume.step >= resume.total_steps and not from_run:
        return replace(plan, note=f"run {candidate} finished ({resume.step} steps): starting a new run")
    return replace(plan, resume=resume)


def start_run(target: Target, release_id: str | None = None, plan: LaunchPlan | None = None) -> RunInfo:
    """Start the target's run in tmux (refuses while one is live). ``release_id`` defaults to current.

    With ``release_id`` given (``fab deploy train`` knows it) this is one command on the target:
    the launcher itself refuses a live run and an existing run directory. Without it, one more
    command first reads the state (live run, current release, latest run id).
    """
    spec = target.spec
    latest: str | None = None
    if plan is not None and plan.release_id is None:
        raise RunError(f"{target.name}: nothing deployed in {spec.workdir}; run `fab deploy` first")
    if plan is not None and plan.resume is not None and plan.release_id is not None:
        info = _launch(target, plan.release_id, plan.resume.run_id, dt.datetime.now(dt.UTC), plan.resume)
        if info is None:
            raise RunError(
                f"{target.name}: run {plan.resume.run_id} is gone from {spec.layout.runs}; "
                "`fab train --fresh` starts a new one"
            )
        return info
    if plan is not None:
        release_id, latest = plan.release_id, plan.latest
    elif release_id is None:
        status = _state(target, 0)
        if status.state == "live":
            raise _live_error(target, status)
        release_id = status.current_release
        latest = status.run_id
        if release_id is None:
            raise RunError(f"{target.name}: nothing deployed in {spec.workdir}; run `fab deploy` first")
    if not RELEASE_ID_RE.match(release_id):
        raise RunError(f"{target.name}: {release_id!r} is not a release id (YYYYmmddTHHMMSSZ-sha7[-dirty])")
    now = dt.datetime.now(dt.UTC)
    for _attempt in range(5):
        run_id = make_run_id(now, spec.run.config, latest)
        info = _launch(target, release_id, run_id, now)
        if info is not None:
            return info
        latest = run_id  # that run id exists already (two starts in one second): take the next
    raise RunError(f"{target.name}: could not find a free run id under {spec.layout.runs}; retry")


def started_line(name: str, info: RunInfo) -> str:
    """What ``fab train`` prints: the run id, and for a resume the step and checkpoint it continues."""
    if info.resumed_from is not None:
        return (
            f"{name}: run {info.run_id} resumed at step {info.resumed_from + 1} from checkpoint "
            f"{info.checkpoint} (release {info.release_id}); `fab logs --follow`"
        )
    return f"{name}: run {info.run_id} started (release {info.release_id}); `fab logs --follow`"


def _launch(
    target: Target,
    release: str,
    run_id: str,
    now: dt.datetime,
    resume: Resume | None = None,
    node: NodeLaunch | None = None,
) -> RunInfo | None:
    """One launch command; None when ``run_id`` exists already (a new run) or is missing (a resume).
    ``node``: this target is one host of a run over several hosts (its torchrun agent)."""
    spec = target.spec
    layout = spec.layout
    run_dir = layout.run_dir(run_id)
    argv = trainer_cli.train(spec, run_dir) if node is None else node.argv(spec, run_dir, run_id)
    info = RunInfo(
        run_id=run_id,
        release_id=release,
        run_dir=run_dir,
        argv=tuple(argv),
        started_at=now.isoformat(timespec="seconds"),
        target=spec.name,
        resumed_from=resume.step if resume else None,
        checkpoint=resume.checkpoint if resume else "",
    )
    record = {
        "run_id": run_id,
        "release": release,
        "release_dir": layout.release(release),
        "run_dir": run_dir,
        "argv": argv,
        "started_at": info.started_at,
        "target": spec.name,
        "module": spec.run.module,
        "config": spec.run.config,
        "env_keys": sorted(spec.run.env),
        "tmux_session": RUN_SESSION,
        "resumed_from": info.resumed_from,
        "checkpoint": info.checkpoint,
    }
    if node is not None:
        record["multi_host"] = node.record()
    mode = "resume" if resume else "new"
    args = [spec.workdir, spec.commands.tmux, RUN_SESSION, run_id, release, mode, json.dumps(record), *argv]
    env = {**run_env(spec), **wrapper_env(spec), **(node.env(spec) if node is not None else {})}
    try:
        target.run(remote.sh("run_launch.sh", *args), stdin=env_file_text(env), timeout=60)
    except CommandFailed as err:
        if err.command_exit_code == EXIT_EXISTS:
            return None
        if err.command_exit_code == EXIT_LIVE:
            status = _state(target, 0)
            if status.state != "live":  # the live run is not runs/latest's: the launcher names it
                raise RunError(
                    f"{target.name}: {scrub(err.stderr_tail, env)}; stop it first with `fab stop`"
                ) from None
            raise _live_error(target, status) from None
        if err.command_exit_code == EXIT_SHORT_ENV:
            raise RunError(
                f"{target.name}: run {run_id} was not started: its environment arrived incomplete on the "
                "target (the connection dropped mid-launch?); nothing was kept: `fab train` again"
            ) from None
        if err.command_exit_code == EXIT_NO_WRAPPER:
            raise RunError(
                f"{target.name}: release {release} is not on the target (or lacks remote/run.sh); "
                "run `fab deploy` again"
            ) from None
        why = scrub(err.stderr_tail, env) or f"exit {err.command_exit_code}"
        raise RunError(
            f"{target.name}: could not start run {run_id}: {why}; nothing of it was kept (runs/latest "
            "still names the previous run): fix the cause and `fab train` again"
        ) from None
    except TargetError as err:
        # The connection dropped: the launch on the target was whole or nothing. Find out which.
        try:
            status = _state(target, 0)
        except TargetError:
            raise TargetError(
                f"{scrub(str(err), env)}; run {run_id} may or may not have started: `fab status` tells"
            ) from None
        if status.run_id == run_id:
            return info
        target.run(remote.sh("run_launch.sh", *args), stdin=env_file_text(env), timeout=60)
    return info


def stop_run(target: Target, force: bool = False, timeout_s: float = 60) -> BasicStatus:
    """SIGTERM (``force``: SIGKILL) the run's process group, wait up to ``timeout_s``, report."""
    spec = target.spec
    sig = "KILL" if force else "TERM"
    wait_s = max(1, math.ceil(timeout_s))
    args = [spec.workdir, spec.commands.tmux, RUN_SESSION, sig, str(wait_s)]
    result = target.run(remote.sh("run_stop.sh", *args), timeout=wait_s + 30)
    words = result.stdout.split()
    outcome = words[0] if words else ""
    if outcome == "none":
        status = _state(target, 0)
        return _with_message(status, "no live run; nothing was stopped")
    if outcome == "mismatch":
        raise RunError(
            f"{target.name}: the live pane of tmux session {RUN_SESSION} is not this workdir's run "
            "(its pgid file is missing or different; one run per container); nothing was signalled; "
            f"inspect it: tmux attach -t {RUN_SESSION}"
        )
    if outcome == "alive":
        what = "SIGKILL" if force else "SIGTERM"
        hint = "check the processes on the target" if force else "wait, or `fab stop --force` kills it"
        raise RunError(f"{target.name}: the run is still running {wait_s}s after {what}; {hint}")
    if outcome != "gone":
        raise RunError(f"{target.name}: unexpected answer from the stop script: {result.stdout[-200:]!r}")
    seconds = int(words[1]) / 10 if len(words) > 1 and words[1].isdigit() else 0.0
    status = _state(target, STATUS_LINES)
    code = "unknown" if status.exit_code is None else status.exit_code
    what = "SIGKILL" if force else "SIGTERM"
    return _with_message(status, f"sent {what}; the run ended {seconds:.1f}s later with exit code {code}")


def _with_message(status: BasicStatus, message: str) -> BasicStatus:
    return replace(status, message=message)


def _log_path(target: Target) -> str:
    return f"{target.spec.layout.latest_run}/{contract.LOG_FILE}"


def read_log(target: Target, lines: int = 50) -> str:
    """The last ``lines`` lines of the latest run's train.log."""
    result = target.run(["tail", "-n", str(max(int(lines), 0)), "--", _log_path(target)], check=False)
    if result.exit_code != 0:
        raise RunError(f"{target.name}: no run log at {_log_path(target)}; `fab train` starts a run")
    return result.stdout


def follow_log(target: Target, lines: int = 50) -> None:
    """Stream the latest run's log (``tail -F``) to this terminal until Ctrl-C."""
    status = _state(target, 0)
    if status.state == "never":
        raise RunError(f"{target.name}: no run started yet; `fab train` starts one")
    argv = ["tail", "-n", str(max(int(lines), 0)), "-F", "--", _log_path(target)]
    try:
        target.run_stream(argv, check=False)
    except KeyboardInterrupt:
        return


# --- run dirs: list and prune -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    """One run dir at a glance (``fab runs``)."""

    run_id: str
    state: State  # LIVE | FINISHED | STOPPED | FAILED
    step: int | None
    total_steps: int | None
    checkpoint_step: int | None  # the newest checkpoint: where `fab train --from` continues
    launches: int
    size_kib: int | None
    latest: bool


def _summary(run_id: str, fields: Mapping[str, str], latest: str) -> RunSummary:
    def event(name: str) -> dict[str, Any]:
        try:
            obj = json.loads(fields.get(name, "") or "{}")
        except json.JSONDecodeError:
            return {}
        return obj if isinstance(obj, dict) else {}

    step, phase = event("step"), event("phase").get("phase")
    exit_code = _int_or_none(fields.get("exit_code", ""))
    if fields.get("alive") == "1":
        state = State.LIVE
    elif phase == "done" and exit_code in (0, None):
        state = State.FINISHED
    elif exit_code == 0 or (exit_code is None and phase == "stopped"):
        state = State.STOPPED
    else:
        state = State.FAILED
    ck = contract.CHECKPOINT_RE.fullmatch(fields.get("checkpoint", ""))
    return RunSummary(
        run_id=run_id,
        state=state,
        step=step.get("step") if isinstance(step.get("step"), int) else None,
        total_steps=step.get("total_steps") if isinstance(step.get("total_steps"), int) else None,
        checkpoint_step=int(ck.group(1)) if ck else None,
        launches=_int_or_none(fields.get("launches", "")) or 0,
        size_kib=_int_or_none(fields.get("size_kib", "")),
        latest=run_id == latest,
    )


def parse_runs_list(text: str) -> tuple[list[RunSummary], list[str]]:
    """``runs_list.sh`` output -> (the runs, oldest first; the run ids removed) (pure)."""
    parts = remote.parse_answers(text)
    latest = remote.ok_output(parts, "latest").strip()
    removed = [line for line in remote.ok_output(parts, "removed").splitlines() if line]
    found = []
    for name, part in parts.items():
        if not name.startswith("run "):
            continue
        fields = {}
        for line in part.output.splitlines():
            key, _, value = line.partition(" ")
            fields[key] = value.strip()
        found.append(_summary(name[4:], fields, latest))
    return found, removed


def list_runs(target: Target, keep: int = 0) -> tuple[list[RunSummary], list[str]]:
    """The target's run dirs; with ``keep`` > 0 first remove those older than the newest ``keep``
    (never runs/latest's, never one whose process group is alive). One command."""
    result = target.run(remote.sh("runs_list.sh", target.spec.workdir, str(max(keep, 0))), timeout=120)
    return parse_runs_list(result.stdout)


def prune_runs(target: Target) -> str:
    """After a launch: keep the newest ``keep_runs`` run dirs; a line saying what went, or ""."""
    _, removed = list_runs(target, keep=target.spec.keep_runs)
    if not removed:
        return ""
    return f"{target.name}: removed {len(removed)} old run dir(s) beyond keep_runs = {target.spec.keep_runs}"


def runs_text(name: str, found: Sequence[RunSummary]) -> str:
    """``fab runs``: one line per run dir, newest last."""
    if not found:
        return f"{name}: no runs yet (`fab train` starts one)"
    rows = [("run", "state", "step", "checkpoint", "launches", "size")]
    for r in found:
        steps = "-" if r.step is None else f"{r.step}/{r.total_steps or '?'}"
        size = "-" if r.size_kib is None else f"{r.size_kib / 1024:.1f} MiB"
        ck = "-" if r.checkpoint_step is None else f"step {r.checkpoint_step}"
        rows.append((r.run_id + (" (latest)" if r.latest else ""), r.state, steps, ck, str(r.launches), size))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{name}:"] + [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)
