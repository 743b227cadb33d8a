"""The default corpus: the Python standard library's own source, as code completions.

Present on every machine that runs Python, so the tiny default needs no download. Each
source file is cut into chunks of ``chunk_lines`` lines; the first ``prompt_lines`` lines of a
chunk are the prompt, the rest the completion. Written once as JSONL into a cache folder
(atomically: a temp file renamed into place) and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3")


def default_cache_dir(configured: str = "") -> Path:
    """``configured``, else ``$FLEET_TRAINING_CACHE``, else ``~/.cache/fleet-training``."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("FLEET_TRAINING_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fleet-training"


def stdlib_sources(max_files: int) -> list[Path]:
    """Up to ``max_files`` stdlib ``.py`` files, in a fixed (sorted) order, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}: cannot build the default corpus")
    # Spread the pick over the whole library rather than the first letters of the alphabet.
    stride = max(1, len(files) // max_files)
    return files[::stride][:max_files]


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
    key_text = f"{sys.version_info[:2]}-{max_files}-{chunk_lines}-{prompt_lines}-v1"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    path = cache_dir / "corpus" / f"stdlib-{key}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for source in stdlib_sources(max_files):
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
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
