"""The trainer's command line as fleet writes it (fleet/trainer_cli.py), checked against the
trainer's own parsers (training/__main__.py, training/run/plan.py): every argv fleet builds is one
the trainer accepts, with the values fleet meant."""

from __future__ import annotations

from dataclasses import replace

from fleet import trainer_cli
from fleet.inventory import MultiRunSpec, NodeSpec, RunSpec, TargetSpec, Topology
from training.__main__ import _parser
from training.config import parse_overrides
from training.run.plan import _parser as plan_parser

SPEC = TargetSpec(
    name="t",
    host="local",
    workdir="/w",
    run=RunSpec(module="training", config="tiny-cpu", overrides=("--train.steps=5",)),
)


def parsed(argv: list[str], module: str = "training") -> tuple[object, list[str]]:
    """The trainer's own reading of ``argv`` (after ``<python> -m <module>``)."""
    assert argv[1:3] == ["-m", module], argv
    args, extra = _parser().parse_known_args(argv[3:])
    parse_overrides(extra)  # what is left over must be --section.key=value overrides
    return args, extra


def test_train_single_process_and_the_managed_env_python() -> None:
    argv = trainer_cli.train(SPEC, "/w/runs/r")
    assert argv[0] == "python3"
    args, extra = parsed(argv)
    assert (args.command, args.config, str(args.run_dir), args.topology) == (
        "train",
        "tiny-cpu",
        "/w/runs/r",
        "",
    )
    assert extra == ["--train.steps=5"]
    assert trainer_cli.train(replace(SPEC, env="train"), "/r")[0] == "/w/envs/train/current/bin/python"


def test_train_under_torchrun_for_a_topology() -> None:
    spec = replace(SPEC, gpus=8, topology=Topology(5, 3))
    argv = trainer_cli.train(spec, "/w/runs/r")
    assert argv[:5] == ["python3", "-m", "training.launch", "--nproc-per-node=8", "-m"]
    args, extra = parsed(["python3", *argv[4:]])
    assert (args.command, args.topology, extra) == ("train", "5+3", ["--train.steps=5"])


def test_node_train_of_a_run_over_two_hosts() -> None:
    run = MultiRunSpec(
        name="wide",
        topology=Topology(2, 2),
        nodes=(
            NodeSpec("a", 2, "10.0.0.1", split=(2, 0)),
            NodeSpec("b", 2, "10.0.0.2", split=(0, 2)),
        ),
        rendezvous="10.0.0.1:29400",
        run=SPEC.run,
    )
    argv = trainer_cli.node_train(SPEC, run, 1, "/w/runs/r", "R")
    split = argv.index("-m", 3)
    assert "--node-rank=1" in argv[:split] and "--rdzv-conf=is_host=false" in argv[:split]
    args, extra = parsed(["python3", *argv[split:]])
    assert (args.topology, args.placement, extra) == ("2+2", "2+0,0+2", ["--train.steps=5"])


def test_warm_resume_check_and_export() -> None:
    args, extra = parsed(trainer_cli.warm(SPEC, if_needed=True))
    assert (args.command, args.config, args.cache_dir, args.if_needed) == (
        "warm",
        "tiny-cpu",
        "/w/compile-cache",
        True,
    )
    assert extra == ["--train.steps=5"]
    args, extra = parsed(trainer_cli.resume_check(SPEC, "/w/runs/r"))
    assert (args.command, str(args.run_dir), extra) == ("resume-check", "/w/runs/r", ["--train.steps=5"])
    args, _ = parsed(trainer_cli.export(SPEC, "/r", "/r/export", None))
    assert (args.command, str(args.out), args.step) == ("export", "/r/export", None)
    assert parsed(trainer_cli.export(SPEC, "/r", "/o", 6))[0].step == 6  # type: ignore[attr-defined]
    assert parsed(trainer_cli.export(SPEC, "/r", "/o", None, gguf=True))[0].gguf is True  # type: ignore[attr-defined]
    args, _ = parsed(trainer_cli.serve_bench(SPEC, "/r", "3,7", 16))
    assert (args.command, str(args.run_dir), args.draft_lengths, args.prompts) == (
        "serve-bench",
        "/r",
        "3,7",
        16,
    )
    args, _ = parsed(trainer_cli.serve_bench(SPEC, "/r", "", 0))
    assert (args.draft_lengths, args.prompts) == ("", 0)


def test_plan_and_always_the_run_module() -> None:
    argv = trainer_cli.plan(SPEC, 8, as_json=True)
    assert argv[1:4] == ["-m", "training", "plan"]
    args, extra = plan_parser().parse_known_args(argv[4:])
    assert (args.config, args.gpus, args.json, extra) == ("tiny-cpu", 8, True, ["--train.steps=5"])
    mine = replace(SPEC, run=replace(SPEC.run, module="mytrainer"))
    for argv in (
        trainer_cli.train(mine, "/r"),
        trainer_cli.warm(mine, if_needed=False),
        trainer_cli.plan(mine, 2, as_json=False),
        trainer_cli.resume_check(mine, "/r"),
        trainer_cli.export(mine, "/r", "/o", None),
    ):
        assert argv[1:3] == ["-m", "mytrainer"], argv
