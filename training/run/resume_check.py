"""``python -m training resume-check``: can this run dir be resumed with this config? (read-only)

fleet asks this on the target before it relaunches a run (``fab train`` resumes by default), so a
changed model/drafter/data setting is refused in one line before anything starts, by the same rule
the trainer applies at start-up (``training.config.resume_mismatches``). Prints one line:

    checkpoint STEP TOTAL_STEPS PATH    the newest complete checkpoint; the config's total steps
    none                                no checkpoint: nothing to resume

and exits 2 with ``changed settings: section.key old -> new; ...`` on stderr when they differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from training.config import ConfigError, load_config, resume_mismatches
from training.contract import CONFIG_FILE, ResumePoint, format_resume_line
from training.run.checkpoint import list_checkpoints


def resume_check(config_name: str, run_dir: Path, overrides: list[str]) -> int:
    config = load_config(config_name, overrides)
    found = list_checkpoints(run_dir)
    if not found:
        print(format_resume_line(None))
        return 0
    saved_path = run_dir / CONFIG_FILE
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{saved_path}: unreadable ({exc}); it belongs to the checkpoints there") from None
    changed = resume_mismatches(saved, config) if isinstance(saved, dict) else []
    if changed:
        print(f"changed settings: {'; '.join(changed)}", file=sys.stderr)
        return 2
    step, path = found[-1]
    print(format_resume_line(ResumePoint(step, config.train.steps, str(path.resolve()))))
    return 0
