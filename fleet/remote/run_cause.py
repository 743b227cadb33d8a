"""Why a failed attempt must not be retried, shipped in every release as remote/run_cause.py and run
by the run's wrapper (remote/run.sh) with the run's python, on the target:

    run_cause.py LOG FROM      prints the first signature whose pattern matches a line of LOG from
                               byte FROM (1-based, like `tail -c +FROM`); prints nothing if none does

The (signature, pattern) rows come from the environment, FLEET_NO_RETRY, one ``signature<TAB>regex``
per line: the not-retryable rows of fleet's diagnosis table (fleet/status/diagnose.py), so the
restart decision and `fab status`'s diagnosis read a log the same way. Lines are cleaned as the
diagnosis cleans them (training.contract.log_lines: NULs, progress bars, torchrun rank prefixes),
imported from the release this file ships in.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).absolute().parent.parent))  # the release: training/ is beside remote/

from training.contract import NO_RETRY_ENV, log_lines


def first_cause(text: str, rows: str) -> str:
    """The signature of the first row (in table order) that matches any cleaned line, or ""."""
    lines = log_lines(text)
    for row in rows.splitlines():
        signature, _, pattern = row.partition("\t")
        if not pattern:
            continue
        regex = re.compile(pattern)
        if any(regex.search(line) for line in lines):
            return signature
    return ""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: run_cause.py LOG FROM", file=sys.stderr)
        return 2
    try:
        with open(argv[0], "rb") as fh:
            fh.seek(max(0, int(argv[1]) - 1))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return 0
    print(first_cause(text, os.environ.get(NO_RETRY_ENV, "")), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
