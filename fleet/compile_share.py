"""Warm once per GPU type: the compile cache's Mega-Cache artefacts kept on the controller and
shipped to every target whose key matches.

A warm-up leaves, per cache key (env lock, torch, triton, GPU type, CUDA: see
``training/compile/cache.py``), ``<workdir>/compile-cache/<key>/megacache.bin`` (every FX graph,
AOTAutograd entry and Triton kernel it compiled, ``torch.compiler.save_cache_artifacts``) and
``manifest.json`` (what it compiled; ``complete: true`` at the end). ``fab warm`` and ``fab train``
(single- and multi-host) call ``push`` before the warm-up and ``pull`` after it:

- ``pull``: every complete artefact on the target that the controller lacks, or holds an older
  one of (the manifest's ``created_at``), comes back to ``.fleet/compile-cache/<key>/`` beside the
  inventory file;
- ``push``: every artefact the controller holds goes to a target that lacks it or holds an older
  one. A training process on that target then finds a complete manifest for its own key and loads
  the blob before its first compile (``cache.activate``): ``warm --if-needed`` skips, training
  starts with 0 FX / AOT misses. A key the target does not have (another GPU type, another env)
  is shipped too but never read there: the key is the whole match rule, so the controller needs
  no knowledge of the target's GPU.

Files move as a tar (base64 on the way back, as ``fab export`` does); on both sides the blob lands
before the manifest, so a half-shipped artefact is never taken for a warm one.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from fleet import remote
from fleet.errors import RunError
from fleet.target import Target
from training.contract import COMPILE_AUTOTUNE_FILE, COMPILE_BLOB_FILE, COMPILE_MANIFEST_FILE

STORE = Path(".fleet") / "compile-cache"
BLOB = COMPILE_BLOB_FILE
MANIFEST = COMPILE_MANIFEST_FILE
AUTOTUNE = COMPILE_AUTOTUNE_FILE  # optional: a warm-up of a target without Triton kernels of its own has none
TRANSFER_TIMEOUT_S = 1800.0
_KEY = re.compile(r"^[A-Za-z0-9_.+-]+$")  # cache.CacheKey.text's alphabet


def store_for(inventory_root: Path) -> Path:
    """The controller's artefact store: ``.fleet/compile-cache`` beside the inventory file (the
    checkout's own ``fleet.toml``: git ignores ``.fleet/``), so each inventory has its own."""
    return inventory_root / STORE


@dataclass(frozen=True)
class Artefact:
    """One key's artefact as its manifest describes it."""

    key: str
    created_at: str
    config: str

    @classmethod
    def parse(cls, key: str, manifest_text: str) -> Artefact | None:
        """The artefact of a complete manifest; None for an incomplete or unreadable one."""
        try:
            data = json.loads(manifest_text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("complete") is not True or not _KEY.match(key):
            return None
        return cls(key=key, created_at=str(data.get("created_at", "")), config=str(data.get("config", "")))


def local_artefacts(store: Path) -> dict[str, Artefact]:
    """The complete artefacts in the controller's store, by key."""
    found: dict[str, Artefact] = {}
    if not store.is_dir():
        return found
    for folder in sorted(store.iterdir()):
        if not (folder / BLOB).is_file():
            continue
        try:
            text = (folder / MANIFEST).read_text(encoding="utf-8")
        except OSError:
            continue
        artefact = Artefact.parse(folder.name, text)
        if artefact is not None:
            found[artefact.key] = artefact
    return found


def parse_listing(text: str) -> dict[str, Artefact]:
    """``remote/compile_list.sh``'s output -> the target's complete artefacts, by key."""
    found: dict[str, Artefact] = {}
    for name, part in remote.parse_answers(text).items():
        kind, _, key = name.partition(" ")
        if kind != "key" or part.exit_code != 0:
            continue
        artefact = Artefact.parse(key, part.output)
        if artefact is not None:
            found[artefact.key] = artefact
    return found


def remote_artefacts(target: Target, root: str) -> dict[str, Artefact]:
    """The complete artefacts under ``root`` (a compile-cache root) on ``target``, by key."""
    res = target.run(remote.sh("compile_list.sh", root, MANIFEST, BLOB), check=False)
    if res.exit_code != 0:
        why = res.stderr.strip() or f"exit {res.exit_code}"
        raise RunError(f"{target.name}: could not list {root}: {why}")
    return parse_listing(res.stdout)


def _newer(mine: Artefact, theirs: Artefact | None) -> bool:
    return theirs is None or mine.created_at > theirs.created_at


def push(target: Target, store: Path, root: str) -> list[str]:
    """Ship the controller's artefacts that ``target`` lacks (or holds older) to its ``root``;
    returns the keys shipped."""
    ours = local_artefacts(store)
    if not ours:
        return []
    theirs = remote_artefacts(target, root)
    shipped = []
    for key, artefact in ours.items():
        if not _newer(artefact, theirs.get(key)):
            continue
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name in (BLOB, AUTOTUNE, MANIFEST):  # the manifest last
                if name != AUTOTUNE or (store / key / AUTOTUNE).is_file():
                    archive.add(store / key / name, arcname=name)
        buffer.seek(0)
        res = target.run(
            remote.sh("compile_put.sh", root, key, BLOB, MANIFEST, AUTOTUNE),
            stdin=buffer,
            check=False,
            timeout=TRANSFER_TIMEOUT_S,
        )
        if res.exit_code != 0:
            raise RunError(
                f"{target.name}: could not install the compile artefact {key}: "
                f"{res.stderr.strip() or f'exit {res.exit_code}'}"
            )
        shipped.append(key)
    return shipped


def pull(target: Target, store: Path, root: str) -> list[str]:
    """Fetch ``target``'s artefacts that the controller lacks (or holds older) into ``store``;
    returns the keys fetched."""
    ours = local_artefacts(store)
    fetched = []
    for key, artefact in remote_artefacts(target, root).items():
        if not _newer(artefact, ours.get(key)):
            continue
        res = target.run(
            remote.sh("compile_pack.sh", root, key, BLOB, MANIFEST, AUTOTUNE),
            check=False,
            timeout=TRANSFER_TIMEOUT_S,
        )
        if res.exit_code != 0:
            raise RunError(
                f"{target.name}: could not read the compile artefact {key}: "
                f"{res.stderr.strip() or f'exit {res.exit_code}'}"
            )
        try:
            data = base64.b64decode("".join(res.stdout.split()), validate=True)
        except binascii.Error as exc:
            raise RunError(f"{target.name}: the compile artefact {key} arrived damaged ({exc})") from None
        _install(store / key, data, f"{target.name}: the compile artefact {key}")
        fetched.append(key)
    return fetched


def _install(folder: Path, tar_bytes: bytes, what: str) -> None:
    """Unpack the artefact tar into ``folder``: the old manifest out, the blob (and the autotune
    results, or an old artefact's removed) in, the manifest last."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
        for member in archive.getmembers():
            name = member.name.removeprefix("./")
            if member.isfile() and name in (BLOB, MANIFEST, AUTOTUNE):
                extracted = archive.extractfile(member)
                if extracted is not None:
                    files[name] = extracted.read()
    if not {BLOB, MANIFEST} <= set(files):
        raise RunError(f"{what} arrived incomplete ({', '.join(sorted(files)) or 'empty'})")
    (folder / MANIFEST).unlink(missing_ok=True)
    if AUTOTUNE not in files:
        (folder / AUTOTUNE).unlink(missing_ok=True)
    for name in (BLOB, AUTOTUNE, MANIFEST):
        if name in files:
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(files[name])
            tmp.replace(folder / name)
