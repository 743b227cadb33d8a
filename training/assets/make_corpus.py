"""Rebuild ``python-stdlib-3.11.7.tar.gz``, the default corpus (see README.md here).

    cd training/assets && python3.11 make_corpus.py /path/to/cpython-3.11.7/Lib python-stdlib-3.11.7.tar.gz

``Lib`` is the ``Lib/`` folder of CPython's v3.11.7 tag (or an installed 3.11.7's
``lib/python3.11``). The archive is byte-for-byte reproducible: files sorted, fixed mtime,
owner and mode, gzip header without a timestamp.
"""

from __future__ import annotations

import gzip
import io
import sys
import tarfile
from pathlib import Path

FILES = 400
SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3")
MTIME = 1701907200  # 2023-12-07, the 3.11.7 release (UTC)


def eligible(lib: Path) -> list[Path]:
    """The library's own modules: tests, IDLE, lib2to3 and build-time generated files left out."""
    files = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith(("test_", "_sysconfigdata")):
            continue
        files.append(path)
    return files


def main(lib: Path, out: Path) -> None:
    files = eligible(lib)
    # An even spread over the whole library, not its first letters.
    picked = [files[i * len(files) // FILES] for i in range(min(FILES, len(files)))]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in [*picked, lib / "LICENSE.txt"]:
            data = path.read_bytes()
            info = tarfile.TarInfo(f"Lib/{path.relative_to(lib).as_posix()}")
            info.size, info.mtime, info.mode = len(data), MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    with (
        open(out, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz,
    ):
        gz.write(buf.getvalue())


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
