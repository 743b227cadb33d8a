"""Compile artefacts kept on the controller and shipped to targets of the same key: two real
``local`` targets (their own workdirs, the shipped sh scripts run by ``sh``), manifests written by
the trainer's own ``Manifest`` class. The end-to-end check (a second target trains with 0 misses
from the shipped blob, CPU inductor) is the slow test in tests/training/compile/test_compile_cache.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit import framed

from fleet import compile_share as cs
from fleet.errors import RunError
from fleet.inventory import TargetSpec
from fleet.target import Target, open_target
from training.compile.cache import Manifest

KEY = "abc123-torch2.11.0+cu130-triton3.6.0-NVIDIA-H200-sm90-cuda13.0"


def _manifest(key: str, created_at: str, *, complete: bool = True) -> str:
    return Manifest(
        key=key,
        config="qwen3-8b-h200",
        config_hash="h",
        buckets=(0, 770, 4097),
        shapes=(),
        variants=2,
        recompile_limit=14,
        seconds=1.0,
        torch="2.11.0",
        triton="3.6.0",
        device="NVIDIA-H200-sm90",
        blob_bytes=5,
        created_at=created_at,
        complete=complete,
    ).to_json()


def _write(root: Path, key: str, created_at: str, blob: bytes, *, complete: bool = True) -> None:
    (root / key).mkdir(parents=True, exist_ok=True)
    (root / key / cs.BLOB).write_bytes(blob)
    (root / key / cs.MANIFEST).write_text(_manifest(key, created_at, complete=complete))


def _target(tmp_path: Path, name: str) -> Target:
    return open_target(TargetSpec(name=name, host="local", workdir=str(tmp_path / name)))


def _root(target: Target) -> str:
    return target.spec.layout.compile_cache


def test_warm_host_to_controller_to_second_host_byte_for_byte(tmp_path: Path) -> None:
    store = tmp_path / "store"
    blob = os.urandom(300_000)
    with _target(tmp_path, "a") as a, _target(tmp_path, "b") as b:
        _write(Path(_root(a)), KEY, "2026-12-01T10:00:00", blob)
        assert cs.pull(a, store, _root(a)) == [KEY]
        assert (store / KEY / cs.BLOB).read_bytes() == blob
        assert cs.pull(a, store, _root(a)) == []  # nothing newer there
        assert cs.push(b, store, _root(b)) == [KEY]
        shipped = Path(_root(b)) / KEY
        assert (shipped / cs.BLOB).read_bytes() == blob
        assert (shipped / cs.MANIFEST).read_text() == (store / KEY / cs.MANIFEST).read_text()
        assert cs.push(b, store, _root(b)) == []  # already there
        assert cs.push(a, store, _root(a)) == []  # where it came from
        assert not [p for p in Path(_root(b)).iterdir() if p.name.startswith(".")]  # no scratch left


def test_the_newest_warm_up_wins_both_ways(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _target(tmp_path, "a") as a:
        _write(store, KEY, "2026-12-01T10:00:00", b"old")
        _write(Path(_root(a)), KEY, "2026-12-01T11:00:00", b"new")
        assert cs.push(a, store, _root(a)) == []  # the target's is newer: kept
        assert cs.pull(a, store, _root(a)) == [KEY]
        assert (store / KEY / cs.BLOB).read_bytes() == b"new"
        _write(store, KEY, "2026-12-01T12:00:00", b"newer")
        assert cs.push(a, store, _root(a)) == [KEY]
        assert (Path(_root(a)) / KEY / cs.BLOB).read_bytes() == b"newer"


def test_incomplete_or_blobless_warm_ups_are_not_shipped(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _target(tmp_path, "a") as a, _target(tmp_path, "b") as b:
        root = Path(_root(a))
        _write(root, KEY, "2026-12-01T10:00:00", b"x", complete=False)  # a warm-up cut short
        _write(root, KEY + "-2", "2026-12-01T10:00:00", b"x")
        (root / (KEY + "-2") / cs.BLOB).unlink()
        assert cs.pull(a, store, _root(a)) == []
        assert cs.local_artefacts(store) == {}
        assert cs.push(b, store, _root(b)) == []  # nothing to ship; b's root need not exist
        assert not Path(_root(b)).exists()


def test_listing_parser_skips_noise_and_damaged_sections() -> None:
    text = "some warning on stderr-turned-stdout\n" + framed(
        ("key " + KEY, 0, _manifest(KEY, "t1")),
        ("key other", 0, "{not json"),
        ("key bad/key", 0, _manifest(KEY, "t2")),
        ("key unread", 1, "cat: manifest.json: Permission denied"),
    )
    assert list(cs.parse_listing(text)) == [KEY]
    assert cs.parse_listing(text)[KEY].created_at == "t1"


def test_a_failed_install_is_one_line_naming_the_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _write(store, KEY, "2026-12-01T10:00:00", b"x")
    with _target(tmp_path, "a") as a:
        blocker = Path(_root(a))
        blocker.parent.mkdir(parents=True)
        blocker.write_text("a file where the cache root should be")
        with pytest.raises(RunError, match=r"could not install the compile artefact"):
            cs.push(a, store, _root(a))


def test_the_target_kernels_autotune_results_travel_and_land_in_the_second_hosts_triton_dir(
    tmp_path: Path,
) -> None:
    """A warm-up's Triton autotune results (fla's ``*.autotune.json``, which the Mega-Cache blob
    does not hold) go a -> controller -> b with the blob, and the trainer's ``activate`` on b puts
    them into its key's triton/ dir; a newer artefact without them takes the old file away."""
    import torch

    from training.compile import cache as cc

    store = tmp_path / "store"
    result = '{"key": [4096, "torch.bfloat16"], "configs_timings": [[{"BT": 64}, [0.5]]]}'
    with _target(tmp_path, "a") as a, _target(tmp_path, "b") as b:
        warm = cc.CacheDir(Path(_root(a)), cc.cache_key(torch.device("cpu")))
        key = warm.key.text
        tuned = warm.triton_dir / "X4ZQ2ABC" / "chunk_gated_delta_rule_fwd_kernel_h.autotune.json"
        tuned.parent.mkdir(parents=True)
        tuned.write_text(result)
        (warm.triton_dir / "KERNEL1" / "kernel.cubin").parent.mkdir(parents=True)
        (warm.triton_dir / "KERNEL1" / "kernel.cubin").write_bytes(b"\x7fELF")  # not a result: stays
        assert cc.pack_autotune(warm) == 1
        _write(Path(_root(a)), key, "2026-12-01T10:00:00", b"blob")
        assert cs.pull(a, store, _root(a)) == [key]
        assert (store / key / cs.AUTOTUNE).is_file()
        assert cs.push(b, store, _root(b)) == [key]
        active = cc.activate(Path(_root(b)), torch.device("cpu"), load=False)
        landed = active.cache.triton_dir / "X4ZQ2ABC" / tuned.name
        assert landed.read_text() == result
        assert not (active.cache.triton_dir / "KERNEL1").exists()
        # the same key warmed again, on a target without kernels of its own: no autotune file
        _write(store, key, "2026-12-01T12:00:00", b"blob2")
        (store / key / cs.AUTOTUNE).unlink()
        assert cs.push(b, store, _root(b)) == [key]
        assert not (Path(_root(b)) / key / cs.AUTOTUNE).exists()
        assert (Path(_root(b)) / key / cs.BLOB).read_bytes() == b"blob2"


def test_an_autotune_archive_is_read_only_for_results_inside_the_triton_dir(tmp_path: Path) -> None:
    import io
    import tarfile

    import torch

    from training.compile import cache as cc

    cache = cc.CacheDir(tmp_path / "root", cc.cache_key(torch.device("cpu")))
    cache.path.mkdir(parents=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in [
            ("../../escaped.autotune.json", b"{}"),  # outside the triton dir
            ("H/not-a-result.py", b"import os"),  # not an autotune result
            ("H/ok.autotune.json", b'{"ok": 1}'),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("L/link.autotune.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        archive.addfile(link)
    cache.autotune_path.write_bytes(buffer.getvalue())
    assert cc.unpack_autotune(cache) == 1
    assert (cache.triton_dir / "H" / "ok.autotune.json").read_text() == '{"ok": 1}'
    assert (
        not (tmp_path / "escaped.autotune.json").exists()
        and not (tmp_path / "root" / "escaped.autotune.json").exists()
    )
    assert not (cache.triton_dir / "H" / "not-a-result.py").exists()
    assert not (cache.triton_dir / "L").exists()
    cache.autotune_path.write_bytes(b"not a tar")
    assert cc.unpack_autotune(cache) == 0  # a damaged archive is skipped: the kernels autotune again
