"""llama-server as a benchmark engine: one server per setting, greedy completions of token-id prompts,
and the server's own speculative-decoding counters.

The numbers are the server's, not ours (llama.cpp ``tools/server``): decode speed from each
response's ``timings`` (``predicted_n`` tokens in ``predicted_ms``, prompt processing excluded),
and acceptance from ``/metrics`` (``--metrics``), read before and after the measured prompts:
``spec_decode_num_draft_tokens_total`` (drafted), ``spec_decode_num_accepted_tokens_total``
(accepted) and ``spec_decode_num_drafts_total`` (verification rounds). The mean accepted length
per round is ``1 + accepted / rounds``: the accepted drafts plus the token the verify pass always
yields, llama.cpp's own "mean len" (``server-context.cpp``) and the project's ``tau``
(``training.run.eval``). Greedy is ``temperature: 0`` (llama.cpp samples greedily at t <= 0).
Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.engines.llamacpp import EngineError, LlamaBuild

SPEC_COUNTERS = {
    "drafted": "llamacpp:spec_decode_num_draft_tokens_total",
    "accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
    "rounds": "llamacpp:spec_decode_num_drafts_total",
}
_METRIC = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)\s*$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition (``/metrics``) -> {name: value}; comments and labels dropped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _METRIC.match(line)
        if match:
            with contextlib.suppress(ValueError):
                values[match[1]] = float(match[2])
    return values


@dataclass(frozen=True)
class Completion:
    """One greedy completion and its timings."""

    tokens: tuple[int, ...]
    text: str
    predicted_n: int
    predicted_ms: float


@dataclass(frozen=True)
class EngineRun:
    """One setting over all prompts: ``draft`` 0 is the target alone."""

    draft: int
    completions: tuple[Completion, ...]
    drafted: int
    accepted: int
    rounds: int

    @property
    def tokens(self) -> int:
        return sum(c.predicted_n for c in self.completions)

    @property
    def tok_s(self) -> float:
        ms = sum(c.predicted_ms for c in self.completions)
        return self.tokens / ms * 1000.0 if ms > 0 else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_len(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, body: dict[str, object] | None = None, timeout: float = 600) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.read()


class LlamaServer:
    """A running llama-server on 127.0.0.1 (a free port), stopped on exit; its log in ``log_file``."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log_file: Path) -> None:
        self.url = url
        self.process = process
        self.log_file = log_file

    def complete(self, prompt: Sequence[int], n_predict: int) -> Completion:
        body = {
            "prompt": list(prompt),
            "n_predict": n_predict,
            "temperature": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
            "seed": 0,
        }
        out = json.loads(_request(f"{self.url}/completion", body))
        timings = out.get("timings", {})
        if "tokens" not in out or "predicted_n" not in timings:
            raise EngineError(f"llama-server's /completion answered without tokens or timings: {sorted(out)}")
        return Completion(
            tokens=tuple(int(t) for t in out.get("tokens", ())),
            text=str(out.get("content", "")),
            predicted_n=int(timings.get("predicted_n", 0)),
            predicted_ms=float(timings.get("predicted_ms", 0.0)),
        )

    def counters(self) -> dict[str, int]:
        values = parse_metrics(_request(f"{self.url}/metrics", timeout=60).decode())
        return {key: int(values.get(name, 0)) for key, name in SPEC_COUNTERS.items()}


def server_argv(
    build: LlamaBuild,
    target: Path,
    drafter: Path | None,
    draft: int,
    *,
    port: int,
    ctx: int,
    threads: int,
    gpu_layers: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The server's argv; ``extra``: more llama-server flags, the same for every setting of a bench."""
    argv = [str(build.binary("llama-server")), "-m", str(target), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", str(ctx), "-np", "1", "-t", str(threads), "-ngl", str(gpu_layers), "--metrics"]
    if drafter is not None and draft > 0:
        argv += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft)]
        argv += ["-ngld", str(gpu_layers), "-td", str(threads)]
    return argv + list(extra)


@contextlib.contextmanager
def llama_server(argv: list[str], log_file: Path, *, start_timeout: float = 300) -> Iterator[LlamaServer]:
    port = int(argv[argv.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                raise EngineError(
                    f"llama-server exited with {process.returncode}: {tail[0]} (log: {log_file})"
                )
            try:
                if json.loads(_request(f"{url}/health", timeout=5)).get("status") == "ok":
                    break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"llama-server did not answer /health within {start_timeout:.0f} s (log: {log_file})"
                )
            time.sleep(0.2)
        yield LlamaServer(url, process, log_file)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_setting(
    build: LlamaBuild,
    target: Path,
    drafter: Path | None,
    draft: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    log_dir: Path,
    *,
    threads: int = 0,
    gpu_layers: int = 0,
    extra: Sequence[str] = (),
) -> EngineRun:
    """All prompts through one fresh server (one warm-up completion first, not counted)."""
    longest = max(len(p) for p in prompts)
    ctx = max(512, 1 << (longest + max_new_tokens + 64).bit_length())
    argv = server_argv(
        build,
        target,
        drafter,
        draft,
        port=_free_port(),
        ctx=ctx,
        threads=threads or os.cpu_count() or 1,
        gpu_layers=gpu_layers,
        extra=extra,
    )
    with llama_server(argv, log_dir / f"llama-server-draft{draft}.log") as server:
        server.complete(prompts[0], min(16, max_new_tokens))
        before = server.counters()
        done = tuple(server.complete(p, max_new_tokens) for p in prompts)
        after = server.counters()
    delta = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    return EngineRun(draft, done, delta["drafted"], delta["accepted"], delta["rounds"])
