"""fleet run notifier, shipped in every release as remote/run_notify.py (stdlib only) and run by the
run's wrapper (remote/run.sh) with the run's python, on the target, next to the run:

    run_notify.py send RUN_DIR STATE CAUSE     one notification (finished / failed / restarted)
    run_notify.py watch RUN_DIR STALL_S        until the wrapper ends: `stalled` once the run has
                                               written no event and no log line for STALL_S seconds
                                               (again after it moved and stalled anew)

Where to: the environment the wrapper gives it (from run.env, never argv): FLEET_NOTIFY_URL (POST
of the JSON body), FLEET_NOTIFY_HEADERS (a JSON object), FLEET_NOTIFY_COMMAND (a JSON argv list,
run with the body on stdin and only the environment ``command_env`` gives it: PATH, HOME, locale and
the run.env keys named in FLEET_NOTIFY_COMMAND_ENV), FLEET_NOTIFY_TARGET. The body is small JSON:
target, run, state, step, cause, fix. The URL and header values may hold secrets: nothing here
prints them; a failed delivery says only its kind (one line in train.log).

The run dir's file names and those variables' names are training.contract's, imported from the
release this file ships in (stdlib only, as this file is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).absolute().parent.parent))  # the release: training/ is beside remote/

from training.contract import (
    ATTEMPTS_FILE,
    EVENTS_FILE,
    EXIT_CODE_FILE,
    LAUNCHED_AT_FILE,
    LOG_FILE,
    NOTIFY_COMMAND_ENV,
    NOTIFY_HEADERS_ENV,
    NOTIFY_PASS_ENV,
    NOTIFY_TARGET_ENV,
    NOTIFY_URL_ENV,
    VARIABLE_PREFIX,
    retry_pending,
)

# Bounded, so a hanging webhook or command cannot hold the wrapper's notifier for long.
WEBHOOK_TIMEOUT_S = 10
COMMAND_TIMEOUT_S = 20
BASE_ENV = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR"}
)

FIXES = {
    "failed": "`fab status` shows the diagnosis; after the fix `fab train` continues from the checkpoint",
    "stalled": "`fab status` and `fab logs` show where it stopped; `fab stop` then `fab train` continues "
    "from the last checkpoint",
    "restarted": "none needed: the run continues from its last checkpoint",
    "finished": "",
}


def last_step(run_dir: Path) -> int | None:
    """The step of the last ``step`` event (the last 64 KiB of events.jsonl)."""
    path = run_dir / EVENTS_FILE
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 65536))
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "step" and isinstance(event.get("step"), int):
            return event["step"]
    return None


def body(run_dir: Path, state: str, cause: str) -> bytes:
    data = {
        "target": os.environ.get(NOTIFY_TARGET_ENV, ""),
        "run": run_dir.name,
        "state": state,
        "step": last_step(run_dir),
        "cause": cause,
        "fix": FIXES.get(state, ""),
    }
    return json.dumps(data, sort_keys=True).encode()


def command_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The notify command's environment: the basics a program needs, plus only the run.env keys
    the inventory names (``notify.command_env``); never the run's other secrets or the notifier's."""
    passed = set((environ.get(NOTIFY_PASS_ENV) or "").split())
    return {
        k: v
        for k, v in environ.items()
        if k in BASE_ENV or (k in passed and not k.startswith(VARIABLE_PREFIX))
    }


def send(run_dir: Path, state: str, cause: str) -> int:
    payload = body(run_dir, state, cause)
    failed = 0
    url = os.environ.get(NOTIFY_URL_ENV, "")
    if url:
        try:
            headers = {
                "Content-Type": "application/json",
                **json.loads(os.environ.get(NOTIFY_HEADERS_ENV) or "{}"),
            }
            request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            print(f"fleet: notify ({state}): the webhook answered HTTP {exc.code}", file=sys.stderr)
            failed = 1
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            print(
                f"fleet: notify ({state}): the webhook is unreachable ({type(reason).__name__})",
                file=sys.stderr,
            )
            failed = 1
        except Exception as exc:  # one line, never the message: it may quote the URL or a header
            print(
                f"fleet: notify ({state}): the webhook request could not be made ({type(exc).__name__}); "
                "check notify.url and notify.headers in the inventory",
                file=sys.stderr,
            )
            failed = 1
    command = json.loads(os.environ.get(NOTIFY_COMMAND_ENV) or "[]")
    if command:
        try:
            done = subprocess.run(
                command, input=payload, env=command_env(os.environ), timeout=COMMAND_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"fleet: notify ({state}): the command failed ({type(exc).__name__})", file=sys.stderr)
            return 1
        if done.returncode != 0:
            print(f"fleet: notify ({state}): the command exited {done.returncode}", file=sys.stderr)
            failed = 1
    return failed


def activity(run_dir: Path) -> float:
    """The last sign of life: an event, a log line, or the wrapper starting an attempt."""
    times = []
    for name in (EVENTS_FILE, LOG_FILE, LAUNCHED_AT_FILE):
        try:
            times.append((run_dir / name).stat().st_mtime)
        except OSError:
            pass
    return max(times) if times else time.time()


def between_attempts(run_dir: Path) -> bool:
    """The restart policy's back-off (``retry_pending``): a wait, not a stall."""
    try:
        last = json.loads((run_dir / ATTEMPTS_FILE).read_text().splitlines()[-1])
        started = float((run_dir / LAUNCHED_AT_FILE).read_text())
    except (OSError, ValueError, IndexError):
        return False
    return isinstance(last, dict) and retry_pending(last, started)


def watch(run_dir: Path, stall_s: float) -> int:
    """Notify ``stalled`` once per stall; ends with the wrapper (its parent) or the run's exit_code."""
    parent = os.getppid()
    notified_at: float | None = None
    interval = max(0.5, min(10.0, stall_s / 4))
    while os.getppid() == parent and not (run_dir / EXIT_CODE_FILE).exists():
        last = activity(run_dir)
        if notified_at is not None and last > notified_at:
            notified_at = None  # it moved again: a later stall is news
        idle = time.time() - last
        if notified_at is None and idle > stall_s and not between_attempts(run_dir):
            send(run_dir, "stalled", f"no new event or log output for {idle:.0f}s")
            notified_at = time.time()
        time.sleep(interval)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "send":
        return send(Path(argv[1]), argv[2], argv[3])
    if len(argv) == 3 and argv[0] == "watch":
        return watch(Path(argv[1]), float(argv[2]))
    print("usage: run_notify.py send RUN_DIR STATE CAUSE | watch RUN_DIR STALL_S", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
