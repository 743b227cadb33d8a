"""Where things live under a target's workdir (see docs/reference/workdir.md). Pure path arithmetic."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

RUN_SESSION = "fleet-run"


@dataclass(frozen=True)
class Layout:
    """Paths on a target, all absolute POSIX paths derived from its workdir."""

    workdir: str

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.workdir, *parts)

    @property
    def releases(self) -> str:
        return self._join("releases")

    def release(self, release_id: str) -> str:
        return self._join("releases", release_id)

    @property
    def current(self) -> str:
        return self._join("current")

    @property
    def runs(self) -> str:
        return self._join("runs")

    def run_dir(self, run_id: str) -> str:
        return self._join("runs", run_id)

    @property
    def latest_run(self) -> str:
        return self._join("runs", "latest")

    @property
    def envs(self) -> str:
        return self._join("envs")

    def env_dir(self, name: str, env_hash: str) -> str:
        return self._join("envs", f"{name}-{env_hash}")

    def env_current(self, name: str) -> str:
        return self._join("envs", name, "current")

    def env_python(self, name: str) -> str:
        return self._join("envs", name, "current", "bin", "python")

    @property
    def compile_cache(self) -> str:
        return self._join("compile-cache")

    @property
    def data_cache(self) -> str:
        return self._join("data-cache")

    @property
    def uv_cache(self) -> str:
        return self._join("uv-cache")

    @property
    def uv_binary(self) -> str:
        return self._join("bin", "uv")
