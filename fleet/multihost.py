"""One run over several hosts (``[runs.NAME]``, selected by ``FLEET_TARGET=NAME``): torchrun's
multi-node launch, one agent per host, joined by its c10d rendezvous. fleet schedules nothing of
its own: each host is a target as usual (its env, releases, tmux session ``fleet-run``, run dir),
and a run over several hosts is the same run id started on each of them with ``--nnodes``,
``--node-rank`` and ``--rdzv-endpoint`` (:class:`fleet.runs.NodeLaunch`).

- ``deploy``: the same release (one release id, one tar of this checkout) on every host, each
  host's env built or checked against the same lock.
- ``train``: every host idle, on that one release, its env undrifted and its GPUs clean; then the
  agents start, the first host's first (it serves the rendezvous). A launch that fails on one host
  stops the agents already started. The run continues the hosts' latest run when all of them
  have it as latest and drafter 0's host (which holds the checkpoints) says it can resume.
- ``stop``: SIGTERM (or SIGKILL) to every host's agent at once.
- ``status``: every host's own status (its events and log), one row per host, and one verdict:
  the worst state, and a host that was lost named as such.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fleet import runs, trainer_cli
from fleet.errors import ConfigError, FleetError, RunError
from fleet.fanout import fan_out, raise_first
from fleet.inventory import Inventory, MultiRunSpec, member_spec
from fleet.status.model import RunStatus, State
from fleet.target import Target, open_target
from training import contract

if TYPE_CHECKING:
    from fleet.doctor import RunNeeds

T = TypeVar("T")


@contextmanager
def opened(inv: Inventory, run: MultiRunSpec) -> Iterator[list[Target]]:
    """Every host of ``run`` as a target whose run is the multi-host run's, opened; closed after."""
    with ExitStack() as stack:
        targets = []
        for i in range(len(run.nodes)):
            target = open_target(member_spec(inv, run, i))
            stack.callback(target.close)
            targets.append(target)
        yield targets


def each(targets: Sequence[Target], work: Callable[[Target], T]) -> list[T]:
    """``work`` on every host at once (:func:`fleet.fanout.fan_out`); the first host's error is raised."""
    return raise_first(fan_out(targets, work, limit=len(targets)))


def deploy(targets: Sequence[Target], repo_root: Path) -> list[str]:
    """The same release on every host: built once per host from this checkout, with one id."""
    from fleet import deploy as fleet_deploy
    from fleet import envs as fleet_envs

    lines = []
    for target in targets:
        env = fleet_envs.ensure_env(target, repo_root)
        if env.managed:
            lines.append(f"{target.name}: env {env.name} {'built' if env.built else 'ok'} ({env.path})")
    now = dt.datetime.now(dt.UTC)
    releases = [fleet_deploy.deploy(t, repo_root, now=now) for t in targets]
    ids = {r.id for r in releases}
    if len(ids) > 1:  # a host had a newer release id already: redeploy the others under the newest
        newest = max(ids)
        stamp = dt.datetime.strptime(newest.split("-", 1)[0], runs.TIME_FORMAT).replace(tzinfo=dt.UTC)
        releases = [
            r if r.id == newest else fleet_deploy.deploy(t, repo_root, now=stamp)
            for t, r in zip(targets, releases, strict=True)
        ]
    for target, release in zip(targets, releases, strict=True):
        lines.append(f"{target.name}: release {release.id} is current ({release.path})")
    return lines


@dataclass(frozen=True)
class Started:
    """What ``train`` launched: the run id, on which hosts, resumed or new."""

    run_id: str
    infos: tuple[runs.RunInfo, ...]
    note: str = ""


def _plan(
    targets: Sequence[Target], run: MultiRunSpec, *, fresh: bool
) -> tuple[str, runs.Resume | None, str]:
    """(the release every host has, the run to continue or None, why a new run); refuses a live
    run on any host and hosts on different releases."""
    states = each(targets, lambda t: runs.basic_status(t, 0))
    for target, st in zip(targets, states, strict=True):
        if st.state == "live":
            raise RunError(
                f"{target.name}: run {st.run_id or '(unknown)'} is live there (one run per target); "
                f"stop it first (`{contract.TARGET_ENV}={target.name} fab stop`, or this run's `fab stop`)"
            )
    currents = [st.current_release for st in states]
    missing = [t.name for t, c in zip(targets, currents, strict=True) if c is None]
    if missing:
        raise RunError(
            f"{', '.join(missing)}: nothing deployed; `{contract.TARGET_ENV}={run.name} fab deploy` first"
        )
    if len(set(currents)) > 1:
        listed = ", ".join(f"{t.name} {c}" for t, c in zip(targets, currents, strict=True))
        raise RunError(
            f"{run.name}: the hosts are on different releases ({listed}); one run needs the same code "
            f"everywhere: `{contract.TARGET_ENV}={run.name} fab deploy`"
        )
    release = currents[0]
    assert release is not None
    latest = {st.run_id for st in states}
    candidate = states[run.checkpoint_node].run_id
    if fresh or candidate is None:
        return release, None, ""
    if len(latest) > 1:
        return (
            release,
            None,
            f"the hosts' latest runs differ ({', '.join(sorted(str(x) for x in latest))}): new run",
        )
    ck = targets[run.checkpoint_node]
    spec = ck.spec
    res = runs.run_with_env(ck, trainer_cli.resume_check(spec, spec.layout.run_dir(candidate)))
    if res.exit_code == 2:
        why = res.stderr.strip().splitlines()[-1:] or ["its settings changed"]
        raise ConfigError(
            f"{ck.name}: run {candidate} cannot resume: {why[0].removeprefix('error: ')}; put them back, "
            "or `fab train --fresh` starts a new run"
        )
    if res.exit_code != 0:
        raise RunError(
            f"{ck.name}: could not check whether run {candidate} can resume "
            f"({runs.failure_summary(res.stderr or res.stdout, res.exit_code)}); "
            "`fab train --fresh` starts a new run"
        )
    resume = runs.parse_resume_check(candidate, res.stdout)
    rejected = [f"{ck.name}: {line}" for line in contract.parse_rejected_lines(res.stdout)]
    if resume is None:
        none = "no checkpoint that passed its check" if rejected else "no checkpoint"
        note = f"run {candidate} has {none} on {ck.name}: starting a new run"
    elif resume.step >= resume.total_steps:
        note, resume = f"run {candidate} finished ({resume.step} steps): starting a new run", None
    else:
        note = ""
    return release, resume, "\n".join([*rejected, note]).strip()


def train(
    targets: Sequence[Target],
    run: MultiRunSpec,
    repo_root: Path,
    *,
    warm: bool,
    fresh: bool,
    deployed: bool,
    store: Path | None = None,
) -> Started:
    """Start (or continue) ``run``: one torchrun agent per host, the first host's first. With
    ``warm``, each host's warm-up gets the controller's compile artefacts (``store``) first and
    hands its own back, so hosts of one GPU type compile once between them."""
    from fleet import envs as fleet_envs
    from fleet import gpus as fleet_gpus

    release, resume, note = _plan(targets, run, fresh=fresh)
    for target in targets:
        if not deployed:
            fleet_envs.refuse_drift(target, repo_root)
        fleet_gpus.gate(target)  # every host's GPUs; refuses on dirty ones, never kills
        if warm:
            runs.warm_cache(target, if_needed=True, store=store)  # the first host's artefact serves the rest
    now = dt.datetime.now(dt.UTC)
    if resume is not None:
        run_id = resume.run_id
    else:
        latest = max((st.run_id or "" for st in each(targets, lambda t: runs.basic_status(t, 0))), default="")
        run_id = runs.make_run_id(now, run.run.config, latest or None)
    infos: list[runs.RunInfo] = []
    try:
        for i, target in enumerate(targets):
            node = runs.NodeLaunch(run, i)
            info = runs._launch(target, release, run_id, now, resume, node)
            if info is None:
                what = "is missing" if resume else "exists already"
                raise RunError(
                    f"{target.name}: run dir {run_id} {what} there; `fab train --fresh` starts a new run"
                )
            infos.append(info)
    except FleetError:
        for target in targets[: len(infos)]:  # no half-started job: the agents already up go
            runs.stop_run(target, force=True, timeout_s=30)
        raise
    return Started(run_id=run_id, infos=tuple(infos), note=note)


def started_lines(run: MultiRunSpec, started: Started) -> list[str]:
    """What ``fab train`` prints for a run over several hosts."""
    first = started.infos[0]
    how = (
        f"resumed at step {first.resumed_from + 1} from checkpoint {first.checkpoint}"
        if first.resumed_from is not None
        else "started"
    )
    lines = [started.note] if started.note else []
    lines.append(
        f"{run.name}: run {started.run_id} {how} on {len(run.nodes)} hosts (release {first.release_id}, "
        f"rendezvous {run.rendezvous}); checkpoints on {run.targets[run.checkpoint_node]}"
    )
    for i, node in enumerate(run.nodes):
        t, d = run.split(i)
        start = run.first_rank(i)
        lines.append(
            f"  {node.target}: node {i}, ranks {start}-{start + node.nproc - 1} ({t} target, {d} drafter)"
        )
    return lines


def stop(targets: Sequence[Target], *, force: bool) -> list[str]:
    """SIGTERM (``force``: SIGKILL) every host's agent at once, each waited for."""
    return [st.text() for st in each(targets, lambda t: runs.stop_run(t, force=force))]


# --- one status for all hosts ---------------------------------------------------------------------


def lost_hosts(run: MultiRunSpec, rows: Sequence[tuple[str, RunStatus | FleetError]]) -> list[str]:
    """The run's hosts that the others lost: named by a surviving rank's error event (its
    ``peer_host``), or whose agent is gone while another host reports an error."""
    named = []
    for _, st in rows:
        if isinstance(st, RunStatus) and st.last_error is not None:
            if st.last_error.peer_host in run.targets:
                named.append(st.last_error.peer_host)
    return list(dict.fromkeys(named))


def verdict(run: MultiRunSpec, rows: Sequence[tuple[str, RunStatus | FleetError]]) -> dict[str, Any]:
    """One state for the whole run: ``failed`` when any host failed (or could not be read), else the
    worst of the hosts' states (by exit code); a lost host named with the cause."""
    states = [st for _, st in rows if isinstance(st, RunStatus)]
    errors = [(n, e) for n, e in rows if not isinstance(e, RunStatus)]
    worst = max(states, key=lambda st: st.exit_code, default=None)
    state = State.FAILED if errors or worst is None else worst.state
    code = State.FAILED.exit_code if state == State.FAILED or worst is None else worst.exit_code
    lost = lost_hosts(run, rows)
    cause = ""
    if lost:
        cause = f"host {', '.join(lost)} lost: the other hosts' ranks stopped waiting for it"
    elif errors:
        cause = "; ".join(f"{n}: {e}" for n, e in errors)
    elif state == State.FAILED:
        failed = [(n, st) for n, st in rows if isinstance(st, RunStatus) and st.state == State.FAILED]
        cause = "; ".join(f"{n}: {st.diagnosis[0].cause if st.diagnosis else 'failed'}" for n, st in failed)
    run_ids = {st.run_id for st in states if st.run_id}
    return {
        "run": run.name,
        "run_id": run_ids.pop() if len(run_ids) == 1 else None,
        "state": state,
        "exit_code": code,
        "lost_hosts": lost,
        "cause": cause,
        "hosts": [
            st.to_json() if isinstance(st, RunStatus) else {"target": n, "error": str(st)} for n, st in rows
        ],
    }


def show(run: MultiRunSpec, rows: Sequence[tuple[str, RunStatus | FleetError]], *, as_json: bool) -> int:
    """``fab status`` of a run over several hosts: one row per host and the verdict line (or one
    JSON object with ``hosts``); returns the verdict's exit code."""
    import json

    from rich.console import Console

    from fleet.status.render import summary_table

    summary = verdict(run, rows)
    if as_json:
        print(json.dumps(summary, sort_keys=True, allow_nan=False), flush=True)
    else:
        Console().print(summary_table(rows))
        print(verdict_line(summary), flush=True)
    return int(summary["exit_code"])


def verdict_line(summary: dict[str, Any]) -> str:
    """``wide (run ...): failed: host ct202 lost: ...``."""
    run_id = f" (run {summary['run_id']})" if summary["run_id"] else ""
    cause = f": {summary['cause']}" if summary["cause"] else ""
    return f"{summary['run']}{run_id}: {summary['state']}{cause}"


# --- what crosses the network (`fab plan`) --------------------------------------------------------


def network_plan(run: MultiRunSpec, needs: RunNeeds, tokens_per_s: float) -> dict[str, Any]:
    """What crosses between hosts and the bandwidth it needs (pure).

    Each target rank sends its hidden states to its partner drafters (``Topology.partners``: the
    drafters of its own host when the placement allows, else all; ``pipeline.order = free``: to
    whichever has credits, so evenly on average), each target an equal share of the batches.
    ``hidden_bytes_per_token`` (target layers x hidden x dtype) times the tokens/s gives the rate;
    each host pair's link carries its part. The drafters' DDP all-reduce crosses hosts too when
    the drafters span several.
    """
    from training.contract import parse_placement

    topo = parse_placement(run.topology, run.placement)
    splits = [run.split(i) for i in range(len(run.nodes))]
    per_token = needs.hidden_bytes_per_token
    shares: dict[tuple[int, int], float] = {}
    for t in topo.target_ranks:
        partners = topo.partners(t)
        for d in partners:
            pair = (topo.node_of(t), topo.node_of(d))
            shares[pair] = shares.get(pair, 0.0) + 1 / (topo.targets * len(partners))
    links = []
    for (i, j), share in sorted(shares.items()):
        if i != j:
            links.append(
                {
                    "from": run.nodes[i].target,
                    "to": run.nodes[j].target,
                    "share": share,
                    "bytes_per_s": share * tokens_per_s * per_token,
                }
            )
    drafter_hosts = [run.nodes[i].target for i, (_, d) in enumerate(splits) if d]
    return {
        "run": run.name,
        "topology": str(topo),
        "hosts": [
            {"target": n.target, "targets": t, "drafters": d, "addr": n.addr}
            for n, (t, d) in zip(run.nodes, splits, strict=True)
        ],
        "tokens_per_s": tokens_per_s,
        "hidden_bytes_per_token": per_token,
        "hidden_states_cross_share": sum(link["share"] for link in links),
        "links": links,
        "ddp_across_hosts": len(drafter_hosts) > 1,
        "ddp_bytes_per_step": 2 * needs.drafter_params * 4 if len(drafter_hosts) > 1 else 0,
        "known": needs.known,
    }


def plan_text(plan: dict[str, Any]) -> str:
    """``fab plan`` for a run over several hosts: where the ranks are and what crosses the network."""
    hosts = "; ".join(
        f"{h['target']}: {h['targets']} target + {h['drafters']} drafter" for h in plan["hosts"]
    )
    lines = [f"{plan['run']}: topology {plan['topology']} over {len(plan['hosts'])} hosts ({hosts})"]
    if not plan["known"]:
        lines.append("the run config was not found here: sizes unknown")
        return "\n".join(lines)
    per_token = plan["hidden_bytes_per_token"]
    rate = plan["tokens_per_s"]
    if not plan["links"]:
        lines.append("hidden states stay on their hosts: every target's drafters are on its own host")
    else:
        lines.append(
            f"hidden states crossing hosts: {plan['hidden_states_cross_share']:.0%} of them, "
            f"{per_token:,} B per token, at {rate:,.0f} tokens/s (--tokens-per-s):"
        )
        for link in plan["links"]:
            mb = link["bytes_per_s"] / 1e6
            lines.append(
                f"  {link['from']} -> {link['to']}: {link['share']:.0%} of the batches, {mb:,.1f} MB/s "
                f"({mb * 8 / 1000:,.2f} Gbit/s)"
            )
    if plan["ddp_across_hosts"]:
        lines.append(
            f"the drafters span hosts: DDP all-reduces {plan['ddp_bytes_per_step'] / 1e6:,.1f} MB of "
            "gradients per step between them (2 x parameters x 4 B, ring)"
        )
    return "\n".join(lines)
