"""The default corpus: Python standard library sources shipped with the trainer, as code completions.

The sources are a fixed archive in this repo (``assets/python-stdlib-3.11.7.tar.gz``: 400 files
of CPython 3.11.7's ``Lib/``, PSF license; ``assets/README.md``), pinned by its sha256, so the
tiny default trains on the same text on every machine whatever Python runs it, and needs no
download. ``max_files`` of them are taken, spread evenly over the archive's sorted list; each
is cut into chunks of ``chunk_lines`` lines, the first ``prompt_lines`` of a chunk being the
prompt and the rest the completion. The result is written once as JSONL into a cache folder
(atomically: a temp file renamed into place) and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from functools import cache
from pathlib import Path

from training.contract import TRAINING_CACHE_ENV

CORPUS_ARCHIVE = Path(__file__).resolve().parents[1] / "assets" / "python-stdlib-3.11.7.tar.gz"
CORPUS_SHA256 = "d9ecec0cfc03f0922d52c38512cb7d7b57ef722b1d717700e6b056da926a1c84"


def default_cache_dir(configured: str = "") -> Path:
    """``configured``, else ``$FLEET_TRAINING_CACHE``, else ``~/.cache/fleet-training``."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get(TRAINING_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fleet-training"


@cache
def shipped_sources() -> tuple[tuple[str, str], ...]:
    """(path, text) of every source file in the shipped archive, sorted by path; checked against
    the pinned sha256 first (a changed archive would silently change every run)."""
    data = CORPUS_ARCHIVE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(
            f"{CORPUS_ARCHIVE}: sha256 {digest} is not the pinned {CORPUS_SHA256}; restore the file "
            "(git checkout) or rebuild it as training/assets/README.md says"
        )
    sources = []
    with tarfile.open(CORPUS_ARCHIVE, mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                handle = tar.extractfile(member)
                assert handle is not None
                sources.append((member.name, handle.read().decode("utf-8")))
    return tuple(sorted(sources))


def corpus_sources(max_files: int) -> list[tuple[str, str]]:
    """Up to ``max_files`` (path, text) of the shipped sources, spread evenly over the archive."""
    files = shipped_sources()
    count = max(0, min(max_files, len(files)))
    return [files[i * len(files) // count] for i in range(count)] if count else []


def chunk_file(text: str, chunk_lines: int, prompt_lines: int) -> list[dict[str, str]]:
    """Completions from one source text: every ``chunk_lines`` lines, prompt = first ``prompt_lines``."""
    lines = text.splitlines(keepends=True)
    records: list[dict[str, str]] = []
    for start in range(0, len(lines), chunk_lines):
        chunk = lines[start : start + chunk_lines]
        if len(chunk) <= prompt_lines:
            continue
        prompt = "".join(chunk[:prompt_lines])
        completion = "".join(chunk[prompt_lines:])
        if completion.strip():
            records.append({"prompt": prompt, "completion": completion})
    return records


def build_default_corpus(cache_dir: Path, max_files: int, chunk_lines: int, prompt_lines: int) -> Path:
    """Write (once) and return the JSONL path of the default corpus for these settings."""
    if prompt_lines < 1 or chunk_lines <= prompt_lines:
        raise ValueError(f"need 1 <= prompt_lines < chunk_lines, got {prompt_lines}, {chunk_lines}")
    key_text = f"{CORPUS_SHA256}-{max_files}-{chunk_lines}-{prompt_lines}-v2"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    path = cache_dir / "corpus" / f"stdlib-{key}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for _name, text in corpus_sources(max_files):
            for record in chunk_file(text, chunk_lines, prompt_lines):
                handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    return path


def iter_texts(path: Path) -> list[str]:
    """Prompt + completion texts of a corpus file (for training a tokenizer)."""
    texts: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            texts.append(record["prompt"] + record["completion"])
    return texts
