"""The default corpus is the shipped archive: the same records whatever Python builds them."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import REPO, require_other_pythons

from training.data import corpus

BUILD = (
    "import sys; from pathlib import Path; from training.data.corpus import build_default_corpus; "
    "print(build_default_corpus(Path(sys.argv[1]), 40, 8, 2))"
)


def test_archive_is_the_pinned_one_and_keeps_its_license() -> None:
    assert hashlib.sha256(corpus.CORPUS_ARCHIVE.read_bytes()).hexdigest() == corpus.CORPUS_SHA256
    names = [name for name, _ in corpus.shipped_sources()]
    assert len(names) == 400 and names == sorted(names) and all(n.startswith("Lib/") for n in names)
    assert not any("/test" in n or "_sysconfigdata" in n for n in names)
    assert (corpus.CORPUS_ARCHIVE.parent / "PYTHON-LICENSE.txt").read_text().startswith("A. HISTORY")


def test_max_files_spreads_over_the_archive() -> None:
    all_names = [name for name, _ in corpus.shipped_sources()]
    picked = [name for name, _ in corpus.corpus_sources(4)]
    assert picked == [all_names[0], all_names[100], all_names[200], all_names[300]]
    assert len(corpus.corpus_sources(10_000)) == 400 and corpus.corpus_sources(0) == []


def test_same_corpus_under_every_python(tmp_path: Path) -> None:
    """Byte-identical JSONL from each interpreter (the stdlib of the one running is never read)."""
    pythons = [sys.executable, *require_other_pythons().values()]
    digests = {}
    for i, python in enumerate(pythons):
        out = subprocess.run(
            [python, "-c", BUILD, str(tmp_path / f"c{i}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        digests[python] = hashlib.sha256(Path(out.stdout.strip()).read_bytes()).hexdigest()
    assert len(set(digests.values())) == 1, digests


def test_an_edited_archive_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    edited = tmp_path / corpus.CORPUS_ARCHIVE.name
    shutil.copy(corpus.CORPUS_ARCHIVE, edited)
    with open(edited, "ab") as handle:
        handle.write(b"\0")
    monkeypatch.setattr(corpus, "CORPUS_ARCHIVE", edited)
    corpus.shipped_sources.cache_clear()
    try:
        with pytest.raises(ValueError, match="is not the pinned"):
            corpus.shipped_sources()
    finally:
        corpus.shipped_sources.cache_clear()
