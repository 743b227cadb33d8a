"""A warm step whose compile fails: the summary (and `fab warm`'s one line) keeps the compiler's own error.

The compiler is real g++ behind a wrapper (set as CXX in the run's environment) that adds a
header with a C++ error to every compile: inductor's CppCompileError then carries g++'s
diagnostic deep in a multi-line message, followed by the source line, the caret and a hint,
which is what a real kernel compile error looks like.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import testkit
from testkit import TINY_COMPILE_OVERRIDES

from training.run.warm import error_summary

REPO = Path(__file__).resolve().parents[3]
FAB = Path(sys.executable).parent / "fab"
COMPILER_ERROR = "was not declared in this scope"


def broken_cxx(tmp_path: Path) -> Path:
    header = tmp_path / "broken.h"
    header.write_text("static int fleet_broken = fleet_undeclared_symbol;\n")
    wrapper = tmp_path / "g++"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --version "*|*" -v "*) exec g++ "$@" ;; esac\n'
        f'exec g++ "$@" -include {header}\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_error_summary_keeps_the_compiler_line() -> None:
    message = (
        "CppCompileError: C++ compile error\n\nCommand:\ng++ x.cpp -Wall -Werror=format -o x.so\n\nOutput:\n"
        "In file included from <command-line>:\n"
        "/tmp/b.h:1:27: error: 'y' was not declared in this scope\n"
        "    1 | static int x = y;\n      |                ^\n\n"
        "Set TORCHDYNAMO_VERBOSE=1 for the internal stack"
    )
    summary = error_summary(RuntimeError(message))
    assert summary == (
        "RuntimeError: CppCompileError: C++ compile error; "
        "compiler: /tmp/b.h:1:27: error: 'y' was not declared in this scope"
    )
    assert error_summary(ValueError("one line")) == "ValueError: one line"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (inductor compiles C++ on CPU)")
def test_fab_warm_names_the_compilers_error(tmp_path: Path, tiny_cache: Path) -> None:
    overrides = ", ".join(json.dumps(o) for o in TINY_COMPILE_OVERRIDES)
    env = {"FLEET_TRAINING_CACHE": str(tiny_cache), "CXX": str(broken_cxx(tmp_path))}
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'default_target = "local"\n[targets.local]\nhost = "local"\nworkdir = "{tmp_path / "wd"}"\n'
        f'gpus = 0\nenv = ""\n[targets.local.run]\nmodule = "training"\nconfig = "tiny-cpu"\n'
        f"overrides = [{overrides}]\nenv = {{ {env_toml} }}\n"
        f'[targets.local.commands]\npython = "{sys.executable}"\n'
    )

    def fab(*args: str) -> subprocess.CompletedProcess[str]:
        return testkit.fab(*args, config=config, timeout=900)

    assert fab("deploy").returncode == 0
    warm = fab("warm")
    assert warm.returncode == 5, warm.stdout[-2000:] + warm.stderr[-2000:]
    last = warm.stderr.strip().splitlines()[-1]  # the command's output streams first; fab's line is last
    assert last.startswith("fleet: local: compile-cache warm-up failed (warm: failed at bucket 0"), last
    assert COMPILER_ERROR in last and "fleet_undeclared_symbol" in last, last
    assert "TORCHDYNAMO_VERBOSE" not in last, last
