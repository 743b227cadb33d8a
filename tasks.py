"""fleet's Fabric tasks (`fab --list`). Pick a target with FLEET_TARGET=<name> (default: fleet.toml's
default_target); read-only tasks also take FLEET_TARGET=all. Each task is a few lines: the work is in
fleet/ (see docs/DESIGN.md)."""

from __future__ import annotations

import json as json_lib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from invoke import Collection, Context
from invoke.exceptions import Exit

from fleet.cli import fleet_task, inventory, map_targets, on_targets, repo_root, selected_run, single_target
from fleet.errors import ConfigError
from training.contract import EVENTS_FILE

if TYPE_CHECKING:
    from fleet.status.model import RunStatus
    from fleet.target import Target

# The fleet modules a task needs are imported inside it: `fab status` then loads only what
# status uses (start-up time is most of its latency).


@fleet_task
def deploy(c: Context) -> None:
    """Upload training/ as a new release and make it current."""
    from fleet import deploy as fleet_deploy
    from fleet import envs as fleet_envs
    from fleet import multihost

    if run := selected_run():  # a run over several hosts: the same release on each
        with multihost.opened(inventory(), run) as targets:
            print("\n".join(multihost.deploy(targets, repo_root())))
        c.config["fleet_deployed"] = {run.name: True}
        return
    with single_target(c) as target:
        env = fleet_envs.ensure_env(target, repo_root())  # builds a missing env; refuses a drifted, unfit one
        if env.managed:
            print(f"{target.name}: env {env.name} {'built' if env.built else 'ok'} ({env.path})")
        release = fleet_deploy.deploy(target, repo_root())
        c.config["fleet_deployed"] = {target.name: release.id}  # `fab deploy train`: train skips a probe
        print(f"{target.name}: release {release.id} is current ({release.path})")
        if target.spec.llamacpp != "off":
            from fleet import engine

            print(engine.ensure_llamacpp(target).text())
        if release.live_release:
            print(
                f"{target.name}: the live run stays on release {release.live_release} (kept); "
                "after `fab stop`, `fab train` continues it on this one"
            )


@fleet_task(
    help={
        "no_warm": "skip the compile-cache warm-up (`fab warm`) before the start",
        "fresh": "start a new run instead of continuing the latest one",
        "from": "continue run RUN_ID (`fab runs` lists them) from its newest checkpoint",
    }
)
def train(c: Context, no_warm: bool = False, fresh: bool = False, from_: str = "") -> None:
    """Start the configured run in tmux, or resume the latest one."""
    from fleet import compile_share, multihost, runs
    from fleet import envs as fleet_envs
    from fleet import gpus as fleet_gpus

    if run := selected_run():  # one torchrun agent per host, joined by the c10d rendezvous
        if from_:
            raise ConfigError(
                f"train --from: not for a run over several hosts ({run.name}); use --fresh or nothing"
            )
        deployed = bool(c.config.get("fleet_deployed", {}).get(run.name))
        with multihost.opened(inventory(), run) as targets:
            store = compile_share.store_for(inventory().root)
            started = multihost.train(
                targets, run, repo_root(), warm=not no_warm, fresh=fresh, deployed=deployed, store=store
            )
        print("\n".join(multihost.started_lines(run, started)))
        return
    with single_target(c) as target:
        deployed = c.config.get("fleet_deployed", {}).get(target.name)
        plan = runs.plan_launch(target, deployed, fresh=fresh, from_run=from_)  # refuses a live run first
        if deployed is None:
            fleet_envs.refuse_drift(target, repo_root())  # `fab deploy` checked it when it ran just now
        fleet_gpus.gate(target)  # refuses on dirty GPUs (GpuGateError names the PIDs); never kills
        if not no_warm:
            # compiles only when the key's cache is not complete (here, or on the controller)
            runs.warm_cache(target, if_needed=True, store=compile_share.store_for(inventory().root))
        for line in (*plan.rejected, plan.note):
            if line:
                print(f"{target.name}: {line}")
        print(runs.started_line(target.name, runs.start_run(target, plan=plan)))
        if line := runs.prune_runs(target):
            print(line)


@fleet_task(help={"json": "print JSON (one object per run dir)"})
def runs(c: Context, json: bool = False) -> None:
    """List the run dirs: state, steps, checkpoint, launches, size."""
    import json as json_lib
    from dataclasses import asdict

    from fleet import runs as fleet_runs

    def show(target: Target) -> str:
        found, _ = fleet_runs.list_runs(target)
        if json:
            return json_lib.dumps([asdict(r) for r in found], sort_keys=True)
        return fleet_runs.runs_text(target.name, found)

    on_targets(c, show)


@fleet_task(
    help={
        "watch": "refresh in place every SECONDS (default 5) until the run ends",
        "json": "print one JSON object (state, phase, step, loss, tokens_per_s, diagnosis, ...)",
        "log": f"read a local run dir, {EVENTS_FILE} or log file instead of a target",
    },
    optional=["watch"],
)
def status(c: Context, watch: str | None = None, json: bool = False, log: str = "") -> None:
    """The run's state, progress, speed, GPUs and diagnosis."""
    from fleet import multihost
    from fleet.status import fetch, render

    interval = render.watch_interval(watch)
    run = None if log or interval is not None else selected_run()
    if run is not None:  # one row per host, one verdict
        code = multihost.show(run, map_targets(c, fetch.fetch_status), as_json=json)
    elif log:
        code = render.show([("local-log", fetch.status_from_path(Path(log).expanduser()))], as_json=json)
    elif interval is None:
        code = render.show(map_targets(c, fetch.fetch_status), as_json=json)  # exit: the worst state's
    else:  # one target, refreshed until its run ends

        def follow(target: Target) -> RunStatus | None:
            return render.watch(fetch.fetch_retrying(target, interval), interval, as_json=json)

        ((_name, st),) = map_targets(c, follow, allow_many=False, why_one="status --watch follows one target")
        code = st.exit_code if st is not None else 0  # None: ended with Ctrl-C
    if code:
        raise Exit(code=code)


@fleet_task(
    help={
        "out": "PNG path (default .fleet/plots/<target>-<run>.png)",
        "log": f"a local run dir or {EVENTS_FILE}",
    }
)
def plot(c: Context, out: str = "", log: str = "") -> None:
    """Plot loss, tau and tokens/s of the latest run as a PNG."""
    from fleet import plot as fleet_plot

    if log:
        print(f"wrote {fleet_plot.plot_log(Path(log).expanduser(), out)}")
        return
    with single_target(c) as target:
        print(f"wrote {fleet_plot.plot_target(target, out)}")


@fleet_task(help={"n": "how many log lines (default 40)", "follow": "keep printing new lines until Ctrl-C"})
def logs(c: Context, n: int = 40, follow: bool = False) -> None:
    """Print the end of the latest run's log (-n N, --follow)."""
    from fleet import runs

    if n < 0:
        raise ConfigError(f"logs -n {n}: give a line count >= 0")
    if follow:
        on_targets(c, lambda target: runs.follow_log(target, n), allow_many=False)
    else:
        on_targets(c, lambda target: runs.read_log(target, n))


@fleet_task(help={"force": "warm again even when the cache of this config is complete"})
def warm(c: Context, force: bool = False) -> None:
    """Fill the compile cache for every shape (a smoke test too)."""
    from fleet import compile_share, runs

    with single_target(c) as target:
        if not runs.warm_cache(target, if_needed=not force, store=compile_share.store_for(inventory().root)):
            print(f"{target.name}: run.module is not the bundled trainer: nothing to warm")


@fleet_task(help={"force": "kill the run at once (SIGKILL) instead of SIGTERM + checkpoint"})
def stop(c: Context, force: bool = False) -> None:
    """Stop the live run (SIGTERM + checkpoint; --force kills)."""
    from fleet import multihost, runs

    if run := selected_run():  # every host's agent
        with multihost.opened(inventory(), run) as targets:
            print("\n".join(multihost.stop(targets, force=force)))
        return
    with single_target(c) as target:
        print(runs.stop_run(target, force=force).text())


@fleet_task(help={"wait": "poll until clean, at most this many seconds", "json": "print JSON"})
def gpus(c: Context, wait: float = 0.0, json: bool = False) -> None:
    """Check that the GPUs are clean to launch on; exit 1 if not."""
    from fleet import gpus as fleet_gpus

    if wait < 0:
        raise ConfigError(f"gpus --wait {wait:g}: give seconds >= 0")
    on_targets(c, lambda target: fleet_gpus.gpus_task(target, wait_s=wait, as_json=json))


@fleet_task(help={"json": "print JSON (drift, extra, missing, changed, ...)", "full": "hash every file"})
def env_check(c: Context, json: bool = False, full: bool = False) -> None:
    """Compare the target's venv with its uv.lock and the GPUs' architecture; exit 1 on drift."""
    from fleet import envs as fleet_envs

    drifted: list[str] = []

    def check(target: Target) -> str:
        if not target.spec.env:
            return f'{target.name}: no managed env (env = ""), nothing to check'
        report = fleet_envs.check_env(target, repo_root(), full=full)
        if report.drift or report.gpu_arch:
            drifted.append(target.name)
        return report.to_json_text() if json else report.text()

    on_targets(c, check)
    if drifted:
        raise Exit(code=1)


@fleet_task(help={"gc": "then remove env builds that no current/previous link, release or run uses"})
def env_rebuild(c: Context, gc: bool = False) -> None:
    """Build the env afresh; switch only once it is verified."""
    from fleet import envs as fleet_envs

    with single_target(c) as target:
        env = fleet_envs.rebuild_env(target, repo_root())
        print(f"{target.name}: env {env.name} rebuilt in {env.build_seconds:.1f}s: {env.describe()}")
        if gc:
            removed = fleet_envs.gc_envs(target)
            print(f"{target.name}: removed {len(removed)} unused env(s): {', '.join(removed) or '-'}")


@fleet_task
def env_rollback(c: Context) -> None:
    """Make the previous env build current again."""
    from fleet import envs as fleet_envs

    with single_target(c) as target:
        env = fleet_envs.rollback_env(target)
        print(f"{target.name}: env {env.name} rolled back, now current: {env.describe()}")


@fleet_task(
    help={
        "json": "print one JSON object (findings, lines, topology, bandwidth, ok)",
        "bandwidth": "also measure send/recv of a batch of hidden states between a target and a drafter GPU",
        "tokens_per_s": "planned tokens/s the target -> drafter link must carry (default 20000)",
    }
)
def doctor(c: Context, json: bool = False, bandwidth: bool = False, tokens_per_s: float = 0.0) -> None:
    """Check the target is fit to train: passthrough, driver, NCCL needs, GPU links; exit 1 if not."""
    from fleet import doctor as fleet_doctor

    rate = tokens_per_s or fleet_doctor.DEFAULT_TOKENS_PER_S
    if rate < 0:
        raise ConfigError(f"doctor --tokens-per-s {rate:g}: give a rate > 0")
    on_targets(
        c,
        lambda target: fleet_doctor.doctor_task(target, as_json=json, bandwidth=bandwidth, tokens_per_s=rate),
    )


@fleet_task(
    help={
        "gpus": "GPUs to split (default: the target's gpus, else 2)",
        "json": "print JSON",
        "tokens_per_s": "a run over several hosts: tokens/s to size its network traffic for (default 20000)",
    }
)
def plan(c: Context, gpus: int = 0, json: bool = False, tokens_per_s: float = 0.0) -> None:
    """Probe target and drafter rates; predict each N+M split."""
    from fleet import doctor, multihost, runs
    from fleet import gpus as fleet_gpus

    if run := selected_run():  # what crosses the network between its hosts, from the run config
        spec = inventory().targets[run.nodes[0].target]
        needs = doctor.run_needs(replace(spec, run=run.run))
        found = multihost.network_plan(run, needs, tokens_per_s or doctor.DEFAULT_TOKENS_PER_S)
        print(json_lib.dumps(found, sort_keys=True) if json else multihost.plan_text(found))
        return
    with single_target(c) as target:
        if target.spec.gpus > 0:
            fleet_gpus.gate(target)  # the probe needs the GPUs to itself
        print(runs.plan(target, gpus or target.spec.gpus or 2, as_json=json))


@fleet_task(
    help={
        "step": "export this checkpoint step (default: the newest)",
        "to": "then copy the folder to this local folder (replaced whole)",
        "gguf": "also the drafter + its target as GGUF for llama.cpp (in <export>-gguf/ on the target)",
    }
)
def export(c: Context, step: int = -1, to: str = "", gguf: bool = False) -> None:
    """Export the latest run's drafter as a folder SGLang/vLLM load (--to copies it here)."""
    from fleet import export as fleet_export

    with single_target(c) as target:
        print(fleet_export.export_drafter(target, step=None if step < 0 else step, to=to, gguf=gguf).text())


@fleet_task(
    name="serve-bench",
    help={
        "draft_lengths": "comma-separated draft lengths (default: 1, 3, block/2 - 1, block - 1)",
        "prompts": "held-out prompts (default: all the run holds out)",
    },
)
def serve_bench(c: Context, draft_lengths: str = "", prompts: int = 0) -> None:
    """The latest run's drafter in llama.cpp vs the target alone: tok/s, speedup, acceptance."""
    from fleet import export as fleet_export

    with single_target(c) as target:
        print(fleet_export.serve_bench(target, draft_lengths=draft_lengths, prompts=prompts))


@fleet_task(help={"json": "print JSON"})
def data(c: Context, json: bool = False) -> None:
    """Report the run's data: records, tokens, drops, lengths, bucket plan."""
    from fleet import runs

    with single_target(c) as target:
        print(runs.data_report(target, as_json=json))


@fleet_task(
    help={
        "input": "JSONL on the target (conversations, messages or prompts); relative = in the release",
        "output": "X.jsonl on the target (+ X_error.jsonl, X_skipped.jsonl); resumed when it exists",
        "server": "host:port or URL, comma-separated (default: the inventory's run.regen_servers)",
        "max_tokens": "per reply (default 4096)",
        "temperature": "default 0.8 (0 = greedy)",
        "concurrency": "requests in flight per server (default 64)",
        "reasoning": "none | save (keep reasoning_content) | disable (thinking off)",
        "retry_errors": "send the records of the error file again",
    }
)
def regen(
    c: Context,
    input: str,
    output: str,
    server: str = "",
    max_tokens: int = 4096,
    temperature: float = 0.8,
    concurrency: int = 64,
    reasoning: str = "none",
    retry_errors: bool = False,
) -> None:
    """Regenerate a data set's replies through the target's serving engines (resumable)."""
    from fleet import runs

    options = ["--max-tokens", str(max_tokens), "--temperature", str(temperature)]
    options += [
        "--concurrency",
        str(concurrency),
        "--reasoning",
        reasoning,
        *(["--retry-errors"] if retry_errors else []),
    ]
    with single_target(c) as target:
        runs.regen(target, input, output, [a for a in server.split(",") if a.strip()], options)


ns = Collection(
    deploy, train, runs, status, plot, logs, stop, gpus, env_check, env_rebuild, env_rollback, plan
)
ns.add_task(export)
ns.add_task(serve_bench)
ns.add_task(doctor)
ns.add_task(warm)
ns.add_task(data)
ns.add_task(regen)
