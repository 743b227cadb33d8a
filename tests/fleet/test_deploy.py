"""fleet.deploy: release ids, pruning, the prepare-output parser, and real deploys to the local target."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from fleet import deploy as d
from fleet.errors import DeployError
from fleet.inventory import Commands, RunSpec, TargetSpec
from fleet.target import LocalTarget, open_target

REPO = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 11, 30, 1, 2, 3, 456000, tzinfo=dt.UTC)


# ------------------------------------------------------------------ pure parts


def test_release_id_format_and_dirty_suffix() -> None:
    assert d.make_release_id(T0, "abcdef1", False) == "20261130T010203Z-abcdef1"
    assert d.make_release_id(T0, "abcdef1", True) == "20261130T010203Z-abcdef1-dirty"
    assert d.RELEASE_ID_RE.match(d.make_release_id(T0, d.NO_COMMIT_SHA, True))


def test_release_id_is_bumped_past_existing_ones_in_the_same_second() -> None:
    first = d.make_release_id(T0, "abcdef1", False)
    second = d.make_release_id(T0, "abcdef1", False, [first, "not-a-release", ".tmp-x"])
    third = d.make_release_id(T0, "1234567", True, [first, second])
    assert second == "20261130T010204Z-abcdef1"
    assert third == "20261130T010205Z-1234567-dirty"
    # A target clock ahead of ours (or an older clock here) still sorts after the newest.
    ahead = "20261130T020000Z-abcdef1"
    assert d.make_release_id(T0, "abcdef1", False, [ahead]) == "20261130T020001Z-abcdef1"


def test_releases_to_prune_keeps_newest_and_protected() -> None:
    ids = [f"20261130T0000{i:02d}Z-abcdef1" for i in range(6)]
    assert d.releases_to_prune(ids, 3) == ids[:3]
    # The new release and a live run's are never pruned; they count towards keep: exactly 3 stay.
    assert d.releases_to_prune(ids, 3, [ids[0], None]) == ids[1:4]
    assert d.releases_to_prune(ids, 3, [ids[5], ids[0]]) == ids[1:4]
    assert d.releases_to_prune(ids, 1, [ids[5], ids[0]]) == ids[1:5]  # two protected: two stay
    # Names that are not release ids are never touched.
    assert d.releases_to_prune([*ids, "keep-me", ".tmp-x"], 6) == []
    assert d.releases_to_prune(ids, 0) == ids[:5]  # at least one always stays


def test_parse_prepare_output_sample() -> None:
    from testkit import framed  # here: this file also runs as a script (the killed deploy's child)

    def text(pane: str) -> str:
        return framed(
            ("current", 0, "releases/20261130T000001Z-abcdef1"),
            ("releases", 0, "20261130T000000Z-abcdef1\n20261130T000001Z-abcdef1"),
            ("pane", 0, pane),
            ("run_json", 0, '{"run_id": "r", "release": "20261130T000000Z-abcdef1"}'),
            ("end", 0, ""),
        )

    state = d.parse_prepare_output(text("0 4242"))
    assert state.current_id == "20261130T000001Z-abcdef1"
    assert state.releases == ("20261130T000000Z-abcdef1", "20261130T000001Z-abcdef1")
    assert state.live_release == "20261130T000000Z-abcdef1"
    dead = text("1 4242")
    assert d.parse_prepare_output(dead).live_release is None
    # A stopped run's release stays known (and protected from pruning): `fab train` may continue it.
    assert d.parse_prepare_output(dead).latest_release == "20261130T000000Z-abcdef1"
    # A failed command's message is not the section's content (no tmux server, no run.json).
    failed = framed(("pane", 1, "0 no server"), ("run_json", 1, "cat: no such file"), ("end", 0, ""))
    assert d.parse_prepare_output(failed) == d.RemoteState(None, (), None, None)
    with pytest.raises(DeployError):
        d.parse_prepare_output(framed(("current", 0, "")))  # cut short: no end section


def test_release_id_from_link() -> None:
    assert d.release_id_from_link("releases/20261130T000001Z-abcdef1") == "20261130T000001Z-abcdef1"
    assert d.release_id_from_link("/w/releases/20261130T000001Z-abcdef1-dirty/") == (
        "20261130T000001Z-abcdef1-dirty"
    )
    assert d.release_id_from_link("releases/whatever") is None
    assert d.release_id_from_link("") is None


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout


def test_git_info_on_a_real_repo(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    assert d.git_info(repo) == d.GitInfo(sha=None, dirty=True, diff_sha256=None)  # no commit yet
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "one")
    clean = d.git_info(repo)
    assert clean.sha == git(repo, "rev-parse", "HEAD").strip()
    assert clean.dirty is False and clean.sha7 == clean.sha[:7]
    (repo / "a.txt").write_text("two\n")
    dirty = d.git_info(repo)
    assert dirty.dirty is True and dirty.sha == clean.sha
    assert dirty.diff_sha256 == hashlib.sha256(git(repo, "diff", "HEAD", "--binary").encode()).hexdigest()
    assert dirty.diff_sha256 != clean.diff_sha256
    assert d.git_info(tmp_path / "nowhere").sha is None


def test_release_tar_ships_training_without_caches(tmp_path: Path) -> None:
    spec = TargetSpec(
        name="t", host="local", workdir=str(tmp_path), run=RunSpec(env=MappingProxyType({"TOKEN": "s3cret"}))
    )
    git_info = d.GitInfo(sha="a" * 40, dirty=False, diff_sha256=None)
    data, manifest = d.build_release_tar(REPO, "20261130T010203Z-aaaaaaa", spec, git_info, T0)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        run_spec = json.loads(tar.extractfile(d.RUN_SPEC_FILE).read())  # type: ignore[union-attr]
        shipped_manifest = json.loads(tar.extractfile(d.MANIFEST_FILE).read())  # type: ignore[union-attr]
    assert "training/__init__.py" in names and "training/selftest.py" in names
    assert "training/assets/general-prompts.jsonl" in names  # the general eval set, read on the target
    assert "remote/run.sh" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert names[-1] == d.MANIFEST_FILE  # last: its presence marks a complete upload
    assert shipped_manifest == manifest
    assert manifest["files"] == len(names) - 2 and manifest["git_sha"] == "a" * 40
    assert run_spec["env_keys"] == ["TOKEN"] and b"s3cret" not in data


# ------------------------------------------------------------------ real deploys (local target)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[LocalTarget]:
    spec = TargetSpec(
        name="t",
        host="local",
        workdir=str(tmp_path / "work dir"),  # a space: paths are passed as arguments, never parsed
        keep_releases=2,
        commands=Commands(python=sys.executable),
    )
    with open_target(spec) as t:
        assert isinstance(t, LocalTarget)
        yield t


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def test_deploy_switches_current_and_records_manifest(target: LocalTarget) -> None:
    assert d.current_release(target) is None
    release = d.deploy(target, REPO)
    work = Path(target.spec.workdir)
    assert os.readlink(work / "current") == f"releases/{release.id}"
    assert (work / "current" / "training" / "selftest.py").is_file()
    assert os.access(work / "current" / "remote" / "run.sh", os.X_OK)
    manifest = json.loads((work / "current" / "MANIFEST.json").read_text())
    assert manifest["release_id"] == release.id and manifest == dict(release.manifest)
    for key in ("git_sha", "dirty", "diff_sha256", "created_at", "user", "files", "bytes"):
        assert key in manifest
    again = d.current_release(target)
    assert again is not None and again.id == release.id and again.path == release.path
    assert dict(again.manifest) == manifest


def test_two_deploys_get_distinct_ordered_ids_and_prune_keeps_n(target: LocalTarget) -> None:
    ids = [d.deploy(target, REPO).id for _ in range(4)]
    assert len(set(ids)) == 4 and ids == sorted(ids)
    releases = sorted(p.name for p in (Path(target.spec.workdir) / "releases").iterdir())
    assert releases == ids[-2:]  # keep_releases = 2
    current = d.current_release(target)
    assert current is not None and current.id == ids[-1]


def test_deploy_killed_mid_stream_leaves_current_intact(
    target: LocalTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = Path(target.spec.workdir)
    first = d.deploy(target, REPO)
    before = tree_digest(work / "releases" / first.id)

    class Cut(Exception):
        pass

    def cut_stream(data: bytes) -> Iterator[bytes]:
        yield data[: len(data) // 2]
        raise Cut("connection cut")

    monkeypatch.setattr(d, "tar_chunks", cut_stream)
    with pytest.raises((Cut, DeployError)):
        d.deploy(target, REPO)
    assert os.readlink(work / "current") == f"releases/{first.id}"
    assert tree_digest(work / "releases" / first.id) == before
    leftovers = [p.name for p in (work / "releases").iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1  # the half upload, never renamed into place
    assert list((work / "releases" / leftovers[0]).rglob("*"))  # it did receive part of the stream

    monkeypatch.undo()
    second = d.deploy(target, REPO)
    names = sorted(p.name for p in (work / "releases").iterdir())
    assert names == sorted([first.id, second.id])  # the leftover was cleaned
    assert os.readlink(work / "current") == f"releases/{second.id}"


def test_deploy_killed_process_leaves_current_intact(target: LocalTarget, tmp_path: Path) -> None:
    """A real `fab deploy`-like process SIGKILLed while its tar upload is half done."""
    work = Path(target.spec.workdir)
    first = d.deploy(target, REPO)
    before = tree_digest(work / "releases" / first.id)
    marker = tmp_path / "half-sent"
    child = subprocess.Popen([sys.executable, __file__, str(work), str(marker)], cwd=REPO)
    try:
        for _ in range(600):
            if marker.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), "the helper never started its upload"
        child.kill()
    finally:
        child.wait()
    assert os.readlink(work / "current") == f"releases/{first.id}"
    assert tree_digest(work / "releases" / first.id) == before
    second = d.deploy(target, REPO)
    assert sorted(p.name for p in (work / "releases").iterdir()) == sorted([first.id, second.id])


def test_install_refuses_a_stream_without_its_manifest(
    target: LocalTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tar cut exactly at a member boundary extracts cleanly; the missing manifest still stops it."""
    work = Path(target.spec.workdir)
    first = d.deploy(target, REPO)

    def without_manifest(data: bytes) -> Iterator[bytes]:
        with tarfile.open(fileobj=io.BytesIO(data)) as src:
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as dst:
                for member in src.getmembers():
                    if member.name != d.MANIFEST_FILE:
                        dst.addfile(member, src.extractfile(member))
        yield out.getvalue()

    monkeypatch.setattr(d, "tar_chunks", without_manifest)
    with pytest.raises(DeployError, match="previous release is still current"):
        d.deploy(target, REPO)
    assert os.readlink(work / "current") == f"releases/{first.id}"


def _slow_upload_main(workdir: str, marker: str) -> None:
    """Child of test_deploy_killed_process_leaves_current_intact: deploy, stall half-way through."""

    def half_then_stall(data: bytes) -> Iterator[bytes]:
        yield data[: len(data) // 2]
        Path(marker).touch()
        time.sleep(3600)  # killed here by the test
        yield data[len(data) // 2 :]

    d.tar_chunks = half_then_stall  # type: ignore[assignment]
    spec = TargetSpec(name="t", host="local", workdir=workdir, keep_releases=2)
    with open_target(spec) as t:
        d.deploy(t, REPO)


if __name__ == "__main__":
    _slow_upload_main(sys.argv[1], sys.argv[2])


def test_a_second_deploy_while_one_is_uploading_is_refused_and_changes_nothing(target: LocalTarget) -> None:
    work = Path(target.spec.workdir)
    first = d.deploy(target, REPO)
    lock = work / ".deploy.lock"
    # A deploy in progress, as the kernel sees it: another process holds the workdir's flock.
    holder = subprocess.Popen(["flock", str(lock), "sleep", "120"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0:
            assert time.monotonic() < deadline, "the lock holder never took the lock"
            time.sleep(0.05)
        (work / "releases" / ".tmp-its-upload").mkdir()  # the running deploy's half upload
        before = sorted(p.name for p in (work / "releases").iterdir())
        busy = r"another `fab deploy` into .* is running; nothing was changed"
        with pytest.raises(DeployError, match=busy):
            d.deploy(target, REPO)
        assert sorted(p.name for p in (work / "releases").iterdir()) == before  # its upload untouched
        assert os.readlink(work / "current") == f"releases/{first.id}"
    finally:
        os.killpg(holder.pid, 9)  # flock and its sleep (which inherited the locked descriptor)
        holder.wait()
    second = d.deploy(target, REPO)  # the lock is free again: the leftover goes, the deploy lands
    assert sorted(p.name for p in (work / "releases").iterdir()) == sorted([first.id, second.id])
    assert os.readlink(work / "current") == f"releases/{second.id}"


def _install(
    workdir: Path, release_id: str, keep: int, *protected: str
) -> subprocess.CompletedProcess[bytes]:
    """deploy_install.sh on this machine with a minimal complete release (a MANIFEST.json)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = json.dumps({"release_id": release_id}).encode()
        info = tarfile.TarInfo(d.MANIFEST_FILE)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    argv = d.remote.sh(
        "deploy_install.sh", str(workdir), f".tmp-{release_id}", release_id, str(keep), *protected
    )
    return subprocess.run(argv, input=buf.getvalue(), capture_output=True, check=False)


@pytest.mark.parametrize("seed", range(6))
def test_install_script_prunes_by_the_same_rule_as_releases_to_prune(tmp_path: Path, seed: int) -> None:
    import random

    rng = random.Random(seed)
    ids = sorted(
        f"2026113{rng.randint(0, 9)}T0{rng.randint(0, 9)}0000Z-abcdef{rng.randint(0, 9)}" for _ in range(8)
    )
    ids = sorted(set(ids))
    new = "20270101T000000Z-abcdef1"
    keep = rng.randint(1, 5)
    protected = rng.sample(ids, rng.randint(0, 2))
    (tmp_path / "releases").mkdir()
    for rid in ids:
        (tmp_path / "releases" / rid).mkdir()
    (tmp_path / "releases" / "not-a-release").mkdir()
    result = _install(tmp_path, new, keep, *protected)
    assert result.returncode == 0, result.stderr
    expected = sorted({*ids, new} - set(d.releases_to_prune([*ids, new], keep, [new, *protected])))
    left = sorted(p.name for p in (tmp_path / "releases").iterdir())
    assert left == sorted([*expected, "not-a-release"])
    assert len(expected) == max(keep, 1 + len(protected))


def test_install_refuses_an_id_that_is_taken_or_not_the_newest(tmp_path: Path) -> None:
    (tmp_path / "releases" / "20261130T000002Z-abcdef1").mkdir(parents=True)
    for rid in ("20261130T000002Z-abcdef1", "20261130T000001Z-abcdef1", "20261130T000002Z-abcdef1-dirty"):
        result = _install(tmp_path, rid, 3)
        assert result.returncode == d.ID_TAKEN_EXIT, (rid, result.stderr)
        assert sorted(p.name for p in (tmp_path / "releases").iterdir()) == ["20261130T000002Z-abcdef1"]
        assert not (tmp_path / "current").exists()
    assert _install(tmp_path, "20261130T000003Z-abcdef1", 3).returncode == 0
