"""Regeneration through a real OpenAI-compatible server: llama.cpp's llama-server serving the
SmolLM2-135M GGUF of the local default (``training.model.smol.gguf_path``).

The prompts are the smol default's own (``shipped_prompts``). A run killed with SIGKILL midway and
started again writes every prompt exactly once; a server that refuses a request (longer than its
context: HTTP 400) or dies midway leaves every record in exactly one of the three files, and the
failed ones are sent again by ``--retry-errors`` once a server is back.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import smol_chat_template

from training.config import DataSection
from training.data.dataset import load_tokenized
from training.data.engine_regen import (
    RegenError,
    RegenSettings,
    base_url,
    conversation,
    done_ids,
    regenerate_file,
    side_paths,
)
from training.data.magpie import MagpieSettings, Sample, rejected, user_turn
from training.data.regen import SERVER_REGEN_FILE, server_regenerated_data, shipped_prompts
from training.model.tinymodel import train_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server_bin(request: pytest.FixtureRequest) -> Path:
    """llama-server: ``$FLEET_LLAMA_SERVER`` (a build made elsewhere), else the session's real
    build (``llama_build``: training.engines.llamacpp, cached per machine)."""
    given = os.environ.get("FLEET_LLAMA_SERVER", "")
    if given:
        return Path(given)
    return request.getfixturevalue("llama_build").binary("llama-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A llama-server process on a free port, started and awaited (``/health``)."""

    def __init__(self, binary: Path, log: Path, ctx: int, slots: int, port: int = 0) -> None:
        from training.model.smol import gguf_path

        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(binary), "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(self.port)]
        # one thread: llama.cpp's threads spin while they wait, and beside the other worker's
        # tests on a 2-core machine two of them spin on each other
        argv += ["-c", str(ctx), "-np", str(slots), "-t", "1"]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if json.loads(response.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"llama-server did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def server(server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(server_bin, tmp_path_factory.mktemp("llama") / "server.log", ctx=2048, slots=2)
    yield running
    running.stop()


def _prompts_file(path: Path, count: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": p}]}) + "\n"
            for i, p in enumerate(shipped_prompts(count))
        )
    )
    return path


def _ids(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [json.loads(line)["_regen_id"] for line in path.read_text().splitlines() if line.strip()]


def test_pure_parts(tmp_path: Path) -> None:
    assert side_paths(tmp_path / "x_regen.jsonl") == (
        tmp_path / "x_regen_error.jsonl",
        tmp_path / "x_regen_skipped.jsonl",
    )
    assert base_url("localhost:30000") == base_url("http://localhost:30000/v1/") == "http://localhost:30000"
    assert conversation({"text": "<|im_start|>..."}).startswith("pre-formatted text")
    assert conversation(
        {"conversations": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    ) == ("starts with an assistant turn")
    sharegpt = conversation(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    )
    assert sharegpt == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ledger = tmp_path / "out.jsonl"
    ledger.write_text('{"_regen_id": "a"}\n{"_regen_id": "b"}\n{"_regen_id": "c", "conv')  # torn by a kill
    assert done_ids([ledger, tmp_path / "none.jsonl"]) == {"a", "b"}
    assert ledger.read_text().endswith('"b"}\n')


def test_no_answering_server_writes_nothing(tmp_path: Path) -> None:
    inputs = _prompts_file(tmp_path / "prompts.jsonl", 3)
    closed = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RegenError, match=r"none of the servers answers .*nothing was written"):
        regenerate_file(inputs, tmp_path / "out.jsonl", RegenSettings(servers=(closed,)), quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


@pytest.mark.slow  # the llama.cpp build (once per machine, minutes on 2 cores)
def test_regenerates_the_smol_prompts_into_data_the_trainer_reads(server: Server, tmp_path: Path) -> None:
    inputs = _prompts_file(tmp_path / "prompts.jsonl", 8)
    skipped_input = {"id": "t", "text": "<|im_start|>user\nhi<|im_end|>\n"}
    with open(inputs, "a") as handle:
        handle.write(json.dumps(skipped_input) + "\n")
    settings = RegenSettings(servers=(server.url,), max_tokens=24, temperature=0.0, concurrency=2)
    reported: list[int] = []
    result = regenerate_file(inputs, tmp_path / "out.jsonl", settings, quiet=True, on_done=reported.append)
    assert (result.success, result.error, result.skipped, result.balanced) == (8, 0, 1, True)
    assert reported == list(range(1, 10))  # one report per record written, cumulative
    assert result.completion_tokens > 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all(
        r["conversations"][1]["role"] == "assistant" and r["conversations"][1]["content"] for r in rows
    )
    tokenizer = train_tokenizer(["Write a Python function that returns a value.\n"] * 20, vocab_size=300)
    loaded = load_tokenized(
        # the toy tokenizer spends about a token per character of code: room for the longest prompt
        DataSection(path=str(tmp_path / "out.jsonl"), max_length=2048),
        tokenizer,
        tmp_path,
        tmp_path / "dc",
    )
    assert len(loaded) == 8
    again = regenerate_file(inputs, tmp_path / "out.jsonl", settings, quiet=True)
    assert (again.sent, again.done_before, again.success) == (0, 9, 8)


@pytest.mark.slow  # the llama.cpp build (once per machine, minutes on 2 cores)
def test_the_trainers_regenerated_set_is_in_the_prompts_order(server: Server, tmp_path: Path) -> None:
    """``data.regen_servers``: replies come back in the order the concurrent requests end; the file
    the trainer reads holds them in the prompts' order (as the in-process path writes them), so the
    run's held-out prompts do not depend on which path wrote the data."""
    lines: list[str] = []
    path = server_regenerated_data(
        tmp_path, "smol", count=8, max_new_tokens=12, servers=server.url, concurrency=4, echo=lines.append
    )
    assert path.name == SERVER_REGEN_FILE
    assert _ids(path) == [f"p{i}" for i in range(8)]
    assert sorted(_ids(path.with_name("regen.jsonl"))) == sorted(_ids(path))  # the same replies
    first = [json.loads(line)["conversations"][0]["content"] for line in path.read_text().splitlines()]
    assert first == shipped_prompts(8)
    before = path.read_bytes()
    path.unlink()  # a cache from before the ordered file: made again from what is there, nothing sent
    again = server_regenerated_data(
        tmp_path, "smol", count=8, max_new_tokens=12, servers="127.0.0.1:1", concurrency=4, echo=lines.append
    )
    assert again == path and path.read_bytes() == before


@pytest.mark.slow  # the llama.cpp build (once per machine, minutes on 2 cores)
def test_magpie_requests_through_the_servers_raw_completions(server: Server, tmp_path: Path) -> None:
    """``data.regen_sources = "stdlib,magpie"`` through the server: SmolLM2 (the GGUF's own template
    cut at the user turn) writes the Magpie half from the prefix (``/v1/completions``), every kept
    request passes the filters, then all are answered; a second run sends nothing."""
    tokenizer = train_tokenizer(["Write a Python function that returns a value.\n"] * 20, vocab_size=300)
    tokenizer.chat_template = smol_chat_template()
    turn = user_turn(tokenizer)
    assert turn.prefix.endswith("<|im_start|>user\n") and turn.end == "<|im_end|>"
    lines: list[str] = []
    settings = MagpieSettings(max_new_tokens=64, seed=1)
    kwargs = {"count": 6, "max_new_tokens": 12, "concurrency": 2, "sources": "stdlib,magpie"}
    path = server_regenerated_data(
        tmp_path, "smol", servers=server.url, magpie=settings, turn=lambda: turn, echo=lines.append, **kwargs
    )
    rows = [json.loads(line)["conversations"] for line in path.read_text().splitlines()]
    requests = [row[0]["content"] for row in rows]
    assert requests[:3] == shipped_prompts(3)
    written = requests[3:]
    assert len(written) == 3 and len(set(written)) == 3, lines
    assert all(rejected(Sample(r, True), turn.markers) is None for r in written)
    assert all(row[1]["role"] == "assistant" and row[1]["content"] for row in rows)
    report = json.loads(next(tmp_path.glob("regen/magpie-*.report.json")).read_text())
    assert (
        report["kept"] == 3
        and report["sampled"] >= 3
        and any(ln.startswith("magpie: 3 requests") for ln in lines)
    )
    again = server_regenerated_data(
        tmp_path,
        "smol",
        servers="127.0.0.1:1",
        magpie=settings,
        turn=lambda: turn,
        echo=lines.append,
        **kwargs,
    )
    assert again == path


@pytest.mark.slow  # the llama.cpp build (once per machine, minutes on 2 cores)
def test_killed_midway_then_resumed_writes_every_prompt_exactly_once(server: Server, tmp_path: Path) -> None:
    count = 12
    inputs = _prompts_file(tmp_path / "prompts.jsonl", count)
    output = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "training", "regen", "--input", str(inputs), "--output", str(output)]
    argv += [
        "--server",
        server.url,
        "--max-tokens",
        "32",
        "--temperature",
        "0",
        "--concurrency",
        "2",
        "--json",
    ]
    first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while len(_ids(output)) < 3 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = len(_ids(output))
    assert 3 <= at_kill < count, f"the kill landed after {at_kill} of {count}"
    second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    written = Counter(_ids(output))
    done_twice = sum(1 for n in written.values() if n > 1)
    lost = count - len(written)
    assert (done_twice, lost, summary["success"], summary["balanced"]) == (0, 0, count, True)
    assert summary["done_before"] == at_kill and summary["sent"] == count - at_kill
    print(f"resume: killed after {at_kill}/{count}, done twice {done_twice}, lost {lost}")


@pytest.mark.slow  # the llama.cpp build (once per machine, minutes on 2 cores)
def test_a_refused_request_and_a_dying_server_lose_nothing(server_bin: Path, tmp_path: Path) -> None:
    count = 10
    # First, so it reaches the live server (one request at a time): longer than the server's
    # context, HTTP 400, recorded at once and not retried.
    huge = {"id": "huge", "conversations": [{"role": "user", "content": "word " * 3000}]}
    inputs = tmp_path / "prompts.jsonl"
    _prompts_file(tmp_path / "rest.jsonl", count)
    inputs.write_text(json.dumps(huge) + "\n" + (tmp_path / "rest.jsonl").read_text())
    output = tmp_path / "out.jsonl"
    log = tmp_path / "server.log"
    first = Server(server_bin, log, ctx=1024, slots=1)
    settings = RegenSettings(
        servers=(first.url,),
        max_tokens=32,
        temperature=0.0,
        concurrency=1,
        retries=2,
        backoff_s=0.05,
    )
    finished = threading.Event()
    killer = threading.Thread(target=lambda: (_wait_for(output, 3, finished), first.stop()))
    killer.start()
    try:
        result = regenerate_file(inputs, output, settings, quiet=True)
    finally:
        finished.set()
        killer.join()
        first.stop()
    error_path, skipped_path = side_paths(output)
    assert result.balanced and result.error >= 1 and result.success >= 3
    assert result.success + result.error == count + 1
    assert sorted(_ids(output) + _ids(error_path)) == sorted([f"p{i}" for i in range(count)] + ["huge"])
    errors = {
        json.loads(line)["_regen_id"]: json.loads(line)["error_kind"]
        for line in error_path.read_text().splitlines()
    }
    assert errors["huge"] == "HTTP 400"
    assert set(errors.values()) <= {"HTTP 400", "connection"}

    second = Server(server_bin, log, ctx=1024, slots=1, port=first.port)
    try:
        retried = regenerate_file(
            inputs, output, RegenSettings(**{**settings.__dict__, "retry_errors": True}), quiet=True
        )
    finally:
        second.stop()
    assert (retried.success, retried.error, retried.balanced) == (count, 1, True)
    assert sorted(_ids(output)) == sorted(f"p{i}" for i in range(count)) and _ids(error_path) == ["huge"]
    assert not skipped_path.read_text()


def _wait_for(path: Path, lines: int, finished: threading.Event) -> None:
    """Until ``path`` holds ``lines`` records or the regeneration has returned: no clock, so a
    loaded machine makes the test slower, never wrong."""
    while len(_ids(path)) < lines and not finished.wait(0.02):
        pass
