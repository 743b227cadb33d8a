"""``python -m training resume-check``: can this run dir be resumed with this config? (read-only)

fleet asks this on the target before it relaunches a run (``fab train`` resumes by default), so a
changed model/drafter/data setting or a corrupt checkpoint is known in one line before anything
starts, by the rule the trainer applies at start-up (``training.run.checkpoint.check_resumable``).
Prints, one per line:

    rejected STEP TEXT                  a newer checkpoint that failed its check (TEXT names it and
                                        why; the trainer sets it aside when the run resumes)
    checkpoint STEP TOTAL_STEPS PATH    the newest checkpoint that passed its check; the config's
                                        total steps
    none                                no checkpoint that passed: nothing to resume

(``training.contract``: ``format_rejected_line``, ``format_resume_line`` and their parsers)
and exits 2 with ``changed settings: section.key old -> new; ...`` on stderr when they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from training.config import load_config
from training.contract import ResumePoint, format_rejected_line, format_resume_line
from training.run.checkpoint import ConfigChanged, check_resumable


def resume_check(config_name: str, run_dir: Path, overrides: list[str]) -> int:
    config = load_config(config_name, overrides)
    try:
        decision = check_resumable(config, run_dir)  # read-only: nothing is set aside here
    except ConfigChanged as exc:
        print(f"changed settings: {'; '.join(exc.changed)}", file=sys.stderr)
        return 2
    for rejected in decision.rejected:
        print(format_rejected_line(rejected.step, rejected.text()))
    point = (
        None if decision.path is None else ResumePoint(decision.step, config.train.steps, str(decision.path))
    )
    print(format_resume_line(point))
    return 0
