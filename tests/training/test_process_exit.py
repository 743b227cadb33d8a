"""training.process_exit: a trainer process ends without the interpreter's teardown, but with what
a normal exit gives: its exit code, its atexit functions, every byte written to its files, and its
live non-daemon threads waited for. Each case runs in a child Python (the function ends its process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = "import sys\nsys.path.insert(0, sys.argv[1])\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, str(REPO), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_exit_code_atexit_functions_and_unclosed_files_survive(tmp_path: Path) -> None:
    done = child(
        """
        import atexit
        from pathlib import Path
        from training.process_exit import exit_process
        out = Path(sys.argv[2])
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        left_open = open(out / "buffered.txt", "w")  # never closed, never flushed
        left_open.write("kept " * 100)
        raw = open(out / "buffered.bin", "wb")
        raw.write(b"bytes")
        print("to stdout", end="")  # a pipe: block-buffered, not yet written
        sys.stderr.write("to stderr")
        sys.exit(exit_process(7))
        """,
        tmp_path,
    )
    assert done.returncode == 7, done.stderr
    assert (done.stdout, done.stderr) == ("to stdout", "to stderr")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "buffered.txt").read_text() == "kept " * 100
    assert (tmp_path / "buffered.bin").read_bytes() == b"bytes"


def test_a_live_non_daemon_thread_gets_the_normal_exit_which_waits_for_it(tmp_path: Path) -> None:
    done = child(
        """
        import threading, time
        from pathlib import Path
        from training.process_exit import exit_process
        out = Path(sys.argv[2])
        def late() -> None:
            time.sleep(0.5)
            (out / "thread").write_text("finished")
        threading.Thread(target=late).start()
        code = exit_process(3)
        print("returned", code)
        sys.exit(code)
        """,
        tmp_path,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "returned 3"  # not ended in place: the interpreter joins the thread
    assert (tmp_path / "thread").read_text() == "finished"


def test_the_trainers_command_line_ends_through_it() -> None:
    """`python -m training` and `python -m training.launch` hand their exit code to exit_process.
    That a usage error through it keeps exit 2 and its one line is
    tests/training/test_config.py::test_cli_config_errors_are_one_line_exit_2 (the same command)."""
    for source in ("training/__main__.py", "training/launch.py"):
        assert "sys.exit(exit_process(" in (REPO / source).read_text(), source


def test_none_is_exit_0_as_sys_exit_has_it(tmp_path: Path) -> None:
    done = child(
        """
        from training.process_exit import exit_process
        print("bye")
        sys.exit(exit_process(None))
        """,
        tmp_path,
    )
    assert (done.returncode, done.stdout) == (0, "bye\n"), done.stderr
