"""fleet.export: `fab export` of a live tiny run on the local target (real deploy, tmux, trainer).

The run trains the tiny CPU default in real tmux; the export reads its newest checkpoint while it
trains, the folder comes back with --to, and the run goes on undisturbed to a clean stop.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest
from testkit import LocalTmux, wait_for

from fleet import deploy as d
from fleet import runs
from fleet.errors import ConfigError, RunError
from fleet.export import export_drafter, fetch_export
from fleet.inventory import Commands, RunSpec, TargetSpec
from fleet.layout import RUN_SESSION
from fleet.target import LocalTarget, open_target
from training.events import read_events, validate_event

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's model cache (the tiny model is built on first use)."""
    return Path(os.environ.get("FLEET_TEST_TRAINING_CACHE") or tmp_path_factory.mktemp("training-cache"))


@pytest.fixture
def target(tmp_path: Path, local_tmux: LocalTmux, tiny_cache: Path) -> Iterator[LocalTarget]:
    spec = TargetSpec(
        name="t",
        host="local",
        workdir=str(tmp_path / "work"),
        keep_releases=2,
        commands=Commands(python=sys.executable),
        run=RunSpec(
            module="training",
            config="tiny-cpu",
            overrides=(
                "--train.steps=100000",
                "--checkpoint.every=3",
                "--checkpoint.keep=100000",  # step 3 stays for the named-step export
                "--eval.num_prompts=0",
                "--train.log_every=1",
                "--train.torch_threads=1",
            ),
            env=MappingProxyType({"FLEET_TRAINING_CACHE": str(tiny_cache)}),
        ),
    )
    with open_target(spec) as t:
        assert isinstance(t, LocalTarget)
        yield t
        local_tmux.run("kill-session", "-t", f"={RUN_SESSION}", check=False)


def _steps(run_dir: str) -> list[int]:
    path = Path(run_dir) / "events.jsonl"
    return [int(e["step"]) for e in read_events(path) if e["event"] == "step"] if path.exists() else []


def test_export_from_a_live_run_copies_the_folder_and_leaves_the_run_alone(
    target: LocalTarget, tmp_path: Path
) -> None:
    with pytest.raises(RunError, match="no run to export"):
        export_drafter(target)
    d.deploy(target, REPO)
    info = runs.start_run(target)
    wait_for("the first checkpoint", lambda: bool(list(Path(info.run_dir, "checkpoints").glob("*.pt"))), 300)
    local = tmp_path / "drafter"
    done = export_drafter(target, to=str(local))
    assert done.run_id == info.run_id and done.step >= 3 and done.step % 3 == 0
    assert done.remote_path == f"{info.run_dir}/export" and done.local_path == local.resolve()
    assert f"step {done.step} exported" in done.text() and str(local.resolve()) in done.text()
    body = json.loads((local / "config.json").read_text())
    assert body["architectures"] == ["DFlashDraftModel"] and body["dflash_config"]["block_size"] == 8
    assert (local / "model.safetensors").stat().st_size > 0 and (local / "tokenizer.json").is_file()
    assert sorted(p.name for p in Path(info.run_dir, "export").iterdir()) == sorted(
        p.name for p in local.iterdir()
    )
    # a named step; one that does not exist is the trainer's one-line error
    again = export_drafter(target, step=3)
    assert again.step == 3 and again.remote_path.endswith("/export-step-3")
    with pytest.raises(RunError, match=r"no checkpoint of step 1 in .*\(have: "):
        export_drafter(target, step=1)
    with pytest.raises(ConfigError, match="not an export"):
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "notes.txt").write_text("mine")
        fetch_export(target, done.remote_path, tmp_path / "busy")  # refused before any command
    # the run went on undisturbed and stops cleanly
    seen = max(_steps(info.run_dir))
    wait_for("more steps", lambda: max(_steps(info.run_dir)) > seen + 2, 300)
    stopped = runs.stop_run(target, timeout_s=120)
    assert stopped.state == "exited" and stopped.exit_code == 0, stopped.text()
    events = read_events(Path(info.run_dir) / "events.jsonl")
    assert all(validate_event(e) == [] for e in events)
    assert not [e for e in events if e["event"] == "error"]
    from safetensors import safe_open

    with safe_open(str(local / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "fc.weight" in names and "layers.1.mlp.down_proj.weight" in names and len(names) == 25


@pytest.mark.parametrize("bad", ["link", "../escape", "/abs"])
def test_an_export_archive_with_anything_but_plain_files_is_refused(bad: str) -> None:
    """The --to copy unpacks plain files and folders under the archive's root only (the rule of
    tarfile's "data" filter, written out for Pythons without it)."""
    import io
    import tarfile

    from fleet.export import _plain_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ok = tarfile.TarInfo("config.json")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"{}"))
        if bad == "link":
            link = tarfile.TarInfo("model.safetensors")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(link)
        else:
            f = tarfile.TarInfo(bad)
            f.size = 1
            tar.addfile(f, io.BytesIO(b"x"))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        with pytest.raises(RunError, match="not a plain file under its folder"):
            _plain_members(tar, "t")
        assert [m.name for m in _plain_members_of_good(tar)] == ["config.json"]


def _plain_members_of_good(tar) -> list:
    """The same archive without its bad member passes the rule."""
    import io
    import tarfile

    from fleet.export import _plain_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as out:
        good = tar.getmember("config.json")
        out.addfile(good, tar.extractfile(good))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as again:
        return _plain_members(again, "t")
