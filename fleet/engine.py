"""``fab deploy`` with ``llamacpp = "cpu" | "auto"``: llama.cpp built on the target, once.

The deployed trainer's ``python -m training.engines.llamacpp build --json`` (stdlib only, in
``<workdir>/current``) builds the pinned source into the target's cache
(``~/.cache/fleet-llama.cpp``, keyed by version, sha256 and backend) or finds it there: a second
deploy costs one command. The build records what it is (``build.json``: version, source sha256,
CUDA architectures); a changed pin is a new key, so a deploy after it builds the new one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fleet.errors import DeployError
from fleet.runs import failure_summary, run_with_env
from fleet.target import Target

BUILD_TIMEOUT_S = 5400.0  # a cold CPU build on 2 busy cores


@dataclass(frozen=True)
class EngineBuild:
    """The llama.cpp build a deploy found or made on the target."""

    target: str
    key: str
    version: str
    cuda: bool
    root: str
    built: bool  # False: found in the cache

    def text(self) -> str:
        how = "built" if self.built else "cached"
        return (
            f"{self.target}: llama.cpp {self.version} ({'CUDA' if self.cuda else 'CPU'}) {how} at {self.root}"
        )


def ensure_llamacpp(target: Target) -> EngineBuild:
    """Build (or find) llama.cpp on the target as its ``llamacpp`` mode says."""
    spec = target.spec
    cuda = "off" if spec.llamacpp == "cpu" else "auto"
    argv = [spec.run_python, "-m", "training.engines.llamacpp", "build", "--cuda", cuda, "--json"]
    res = run_with_env(target, argv, timeout=BUILD_TIMEOUT_S)
    if res.exit_code != 0:
        raise DeployError(
            f"{target.name}: llama.cpp build failed ({failure_summary(res.stderr, res.exit_code)})"
        )
    try:
        found = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise DeployError(
            f"{target.name}: the llama.cpp build printed no result: {res.stdout[-300:]!r}"
        ) from None
    return EngineBuild(
        target.name,
        str(found["key"]),
        str(found["version"]),
        bool(found["cuda"]),
        str(found["root"]),
        built="building llama.cpp" in res.stderr,
    )
