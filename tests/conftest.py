"""Fixtures shared by every test tier; the helpers themselves live in tests/testkit.py.

Tests import helpers with `from testkit import ...` (a unique module name: `import conftest`
would be ambiguous, since tests/training has a conftest.py of its own).
"""

from testkit import hosts, llama_build, local_tmux, remote_fleet

__all__ = ["hosts", "llama_build", "local_tmux", "remote_fleet"]
