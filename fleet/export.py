"""``fab export``: the latest run's trained drafter as a folder SGLang / vLLM load.

One command on the target runs the deployed trainer's ``python -m training export`` (in
``<workdir>/current``, with the run's environment on stdin as ``fab warm`` does) on the latest
run's newest complete checkpoint (or ``--step N``), into ``<run-dir>/export`` (``export-step-N``
for a given step). The trainer reads only complete checkpoints and writes the folder next to
its final place, then renames it, so exporting from a live run neither disturbs it nor leaves a
half folder. ``--to LOCAL_DIR`` then brings the folder here: one more command prints it as a
base64 tar (``remote/export_pack.sh``), unpacked into a temp folder beside ``LOCAL_DIR`` and
renamed onto it.

``--gguf`` adds the trainer's ``--gguf``: the drafter and its target as GGUF files for llama.cpp
(``training.engines.gguf``), next to the export. ``serve_bench`` (``fab serve-bench``) runs the
trainer's ``serve-bench`` on the latest run the same way (``training.engines.serve_bench``).
"""

from __future__ import annotations

import base64
import binascii
import io
import posixpath
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from fleet import remote, trainer_cli
from fleet.errors import ConfigError, RunError
from fleet.runs import basic_status, failure_summary, run_with_env
from fleet.target import Target
from training.contract import HF_CONFIG_FILE

EXPORTED_RE = re.compile(r"^exported step (\d+) \((.*)\) -> (.+)$", re.MULTILINE)
EXPORT_TIMEOUT_S = 1800.0  # reading a 27B run's checkpoint and writing bf16 weights: minutes at most
# --gguf may first build llama.cpp on the target (training.engines.llamacpp; ~25 min on 2 cores, once)
GGUF_TIMEOUT_S = 5400.0
GGUF_RE = re.compile(r"^drafter GGUF (.+); target GGUF (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class ExportResult:
    """Where the export is on the target (and here, with ``--to``)."""

    target: str
    run_id: str
    step: int
    remote_path: str
    detail: str
    local_path: Path | None = None
    gguf: str = ""  # with --gguf: the trainer's line naming the drafter's and the target's GGUF files

    def text(self) -> str:
        head = f"{self.target}: run {self.run_id} step {self.step} exported ({self.detail})"
        lines = [f"{head} -> {self.remote_path}"]
        if self.gguf:
            lines.append(f"{self.target}: {self.gguf}")
        if self.local_path is not None:
            lines.append(f"{self.target}: copied to {self.local_path}")
        return "\n".join(lines)


def export_drafter(
    target: Target, *, step: int | None = None, to: str = "", gguf: bool = False
) -> ExportResult:
    """``fab export [--step N] [--to LOCAL_DIR]`` (see the module docstring)."""
    if step is not None and step < 0:
        raise ConfigError(f"export --step {step}: give a checkpoint step >= 0")
    spec = target.spec
    if spec.run.module != "training":
        raise RunError(
            f"{target.name}: run.module {spec.run.module!r} is not the bundled trainer: nothing to export"
        )
    status = basic_status(target, lines=0)
    if not status.run_id:
        raise RunError(f"{target.name}: no run to export: start one with `fab train`")
    run_dir = spec.layout.run_dir(status.run_id)
    out = posixpath.join(run_dir, "export" if step is None else f"export-step-{step}")
    res = run_with_env(
        target,
        trainer_cli.export(spec, run_dir, out, step, gguf=gguf),
        timeout=GGUF_TIMEOUT_S if gguf else EXPORT_TIMEOUT_S,
    )
    if res.exit_code != 0:
        why = failure_summary(res.stderr or res.stdout, res.exit_code)
        raise RunError(f"{target.name}: export of run {status.run_id} failed ({why})")
    found = EXPORTED_RE.search(res.stdout)
    if found is None:
        raise RunError(
            f"{target.name}: the trainer's export printed no result line: {res.stdout.strip()[-300:]!r}"
        )
    converted = GGUF_RE.search(res.stdout)
    result = ExportResult(
        target.name,
        status.run_id,
        int(found.group(1)),
        found.group(3).strip(),
        found.group(2),
        gguf=converted.group(0).strip() if converted else "",
    )
    if to:
        local = fetch_export(target, result.remote_path, Path(to).expanduser())
        result = replace(result, local_path=local)
    return result


def _plain_members(archive: tarfile.TarFile, where: str) -> list[tarfile.TarInfo]:
    """The archive's members when every one is a plain file or folder under the archive's root
    (what tarfile's "data" filter allows for an export; that filter is missing from Python
    3.11.0-3.11.3, e.g. Debian 12's 3.11.2, so the rule is written out here)."""
    members = archive.getmembers()
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts:
            raise RunError(f"{where}: the export archive holds {m.name!r}, not a plain file under its folder")
    return members


def fetch_export(target: Target, remote_path: str, dest: Path) -> Path:
    """Copy the exported folder ``remote_path`` on the target to ``dest`` (replaced whole)."""
    dest = dest.resolve()
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"export --to {dest} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"export --to {dest} is a non-empty folder that is not an export: choose another")
    res = target.run(remote.sh("export_pack.sh", remote_path), check=False, timeout=EXPORT_TIMEOUT_S)
    if res.exit_code != 0:
        raise RunError(
            f"{target.name}: could not read {remote_path}: {res.stderr.strip() or f'exit {res.exit_code}'}"
        )
    try:
        data = base64.b64decode("".join(res.stdout.split()), validate=True)
    except binascii.Error as exc:
        raise RunError(f"{target.name}: the export of {remote_path} arrived damaged ({exc})") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(tmp, members=_plain_members(archive, target.name))
        if not (tmp / HF_CONFIG_FILE).is_file():
            raise RunError(f"{target.name}: {remote_path} holds no {HF_CONFIG_FILE}")
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def serve_bench(target: Target, *, draft_lengths: str = "", prompts: int = 0) -> str:
    """``fab serve-bench``: ``python -m training serve-bench`` on the latest run (its table; the
    ``serve_bench`` event lands in the run's events, so ``fab status`` shows the figure)."""
    spec = target.spec
    if spec.run.module != "training":
        raise RunError(
            f"{target.name}: run.module {spec.run.module!r} is not the bundled trainer: no drafter"
        )
    status = basic_status(target, lines=0)
    if not status.run_id:
        raise RunError(f"{target.name}: no run to benchmark: start one with `fab train`")
    argv = trainer_cli.serve_bench(spec, spec.layout.run_dir(status.run_id), draft_lengths, prompts)
    res = run_with_env(target, argv, timeout=GGUF_TIMEOUT_S)
    if res.exit_code != 0:
        why = failure_summary(res.stderr or res.stdout, res.exit_code)
        raise RunError(f"{target.name}: serve-bench of run {status.run_id} failed ({why})")
    table = (
        res.stdout[res.stdout.find("serve-bench step") :] if "serve-bench step" in res.stdout else res.stdout
    )
    return f"{target.name}: run {status.run_id}\n{table.strip()}"
