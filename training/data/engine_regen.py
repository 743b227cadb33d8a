"""Regeneration through serving engines: a data set's prompts sent to OpenAI-compatible servers
(SGLang, vLLM, llama.cpp's llama-server), their replies written as training data.

The rules are SpecForge's ``scripts/regenerate_train_data.py``: each conversation's system and user
turns are replayed in order, every assistant turn replaced by the server's reply to the turns so
far (``/v1/chat/completions``); ``reasoning`` "save" keeps the reply's ``reasoning_content``,
"disable" asks the template for no thinking (``chat_template_kwargs.enable_thinking``); a record
that cannot be regenerated (no user turn, a pre-formatted text) is written to ``*_skipped.jsonl``,
one whose request failed to ``*_error.jsonl``, the rest to the output; the run passes its
accounting only when success + error + skipped == input.

Where SpecForge's resume counts lines and skips that many inputs (a reply that finished out of
order, or a line torn by a kill, makes that count wrong), here every record has an id (its ``id``,
else ``line-N``) and the three files are the ledger: a resume reads the ids already in them,
cuts a torn last line, and sends only the others; each result is appended as one line and flushed
before the next. Nothing is sent twice, nothing is lost, whatever stopped the previous run.

Requests: at most ``concurrency`` in flight per server, servers taken in turn; a connection error,
a timeout, HTTP 429 or 5xx is retried with exponential backoff on the next server, up to
``retries`` times; any other HTTP error is the record's error at once (the request itself is bad,
e.g. longer than the server's context). stdlib ``urllib`` only: it runs on the target, next to
the data and usually the servers, in the trainer's env, and needs no client library there.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.config import ConfigError, TrainingError
from training.data.formats import SHAREGPT_ROLES, record_format

REASONING_MODES = ("none", "save", "disable")
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RegenError(TrainingError):
    """A regeneration that could not finish (its servers failed): exit 1, one line."""


@dataclass(frozen=True)
class RegenSettings:
    servers: tuple[str, ...]
    model: str = "default"
    max_tokens: int = 4096
    temperature: float = 0.8
    concurrency: int = 64  # per server
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    reasoning: str = "none"
    num_samples: int = 0  # 0 = all
    retry_errors: bool = False  # send the records of the error file again (it is kept as X_error.jsonl.prev)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("regen: no server address; give --server URL (host:port or http://host:port)")
        if not 0.0 <= self.temperature <= 2.0:
            raise ConfigError(f"regen: temperature must be in [0, 2], got {self.temperature}")
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"regen: {name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ConfigError(f"regen: retries must be >= 0, got {self.retries}")
        if self.reasoning not in REASONING_MODES:
            modes = ", ".join(REASONING_MODES)
            raise ConfigError(f"regen: reasoning must be one of {modes}, got {self.reasoning!r}")


@dataclass(frozen=True)
class RegenResult:
    output: str
    input_records: int
    success: int
    error: int
    skipped: int
    done_before: int  # ids already in the three files when this run started
    sent: int  # records sent by this run
    completion_tokens: int
    seconds: float
    errors_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def balanced(self) -> bool:
        return self.success + self.error + self.skipped == self.input_records

    def text(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        verdict = "ok" if self.balanced else "MISMATCH"
        lines = [
            f"regenerated {self.output}: {self.success} success, {self.error} error, {self.skipped} skipped "
            f"of {self.input_records} input records (accounting {verdict})",
            f"this run: {self.sent} sent, {self.done_before} already done, {self.completion_tokens} "
            f"completion tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s)",
        ]
        lines += [f"  errors: {n} x {kind}" for kind, n in sorted(self.errors_by_kind.items())]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "balanced": self.balanced}, sort_keys=True)


def side_paths(output: Path) -> tuple[Path, Path]:
    """``X_error.jsonl`` and ``X_skipped.jsonl`` next to ``X.jsonl`` (SpecForge's names)."""
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(f"{stem}_error.jsonl"), output.with_name(f"{stem}_skipped.jsonl")


def base_url(address: str) -> str:
    address = address.rstrip("/")
    if not address.startswith(("http://", "https://")):
        address = f"http://{address}"
    return address[: -len("/v1")] if address.endswith("/v1") else address


def read_inputs(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(id, record) of each line of a JSONL input; the id is ``id`` or ``line-N``."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"regen: {path} line {number}: not JSON ({exc.msg})") from None
            rid = record.get("id") if isinstance(record, dict) else None
            yield (str(rid) if rid not in (None, "") else f"line-{number}"), record


def done_ids(paths: Sequence[Path]) -> set[str]:
    """The ids in the ledger files; a last line torn by a kill (no newline) is cut off first."""
    done: set[str] = set()
    for path in paths:
        if not path.is_file():
            continue
        with open(path, "rb+") as handle:
            data = handle.read()
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                handle.truncate(cut)
        for line in data[:cut].decode("utf-8").splitlines():
            if line.strip():
                done.add(str(json.loads(line)["_regen_id"]))
    return done


def conversation(record: Any) -> list[dict[str, Any]] | str:
    """The record's turns as role/content, or why it cannot be regenerated."""
    if not isinstance(record, dict):
        return "not a JSON object"
    fmt = record_format(record)
    if fmt == "specforge":
        turns = [dict(t) for t in record["conversations"]]
    elif fmt == "sharegpt":
        turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]
    elif fmt == "messages":
        turns = [dict(t) for t in record["messages"]]
    elif fmt == "completion":
        turns = [{"role": "user", "content": record["prompt"]}]
    elif fmt == "text":
        return "pre-formatted text: its prompts cannot be told from its replies"
    else:
        return f"no known format (keys {sorted(record)})"
    if not any(t.get("role") == "user" for t in turns):
        return "no user turn"
    if turns[0].get("role") == "assistant":
        return "starts with an assistant turn"
    bad = [t.get("role") for t in turns if t.get("role") not in ("system", "user", "assistant")]
    if bad:
        return f"unknown role {bad[0]!r}"
    return turns


class RequestError(Exception):
    def __init__(self, kind: str, detail: str, retry: bool) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.retry = kind, retry


def post(url: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One JSON POST to ``url + path``; ``RequestError`` says whether a retry may help."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer none"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        raise RequestError(f"HTTP {exc.code}", detail, exc.code in RETRY_STATUS) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RequestError("connection", str(reason), True) from None
    except json.JSONDecodeError as exc:
        raise RequestError("bad response", exc.msg, True) from None


def answering(urls: Sequence[str], timeout: float = 10.0) -> list[str]:
    """The servers that answer ``GET /v1/models`` (SpecForge probes each server before it starts
    too): a server down at the start is left out instead of turning every record into an error."""
    found = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
                response.read()
            found.append(url)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            print(
                f"regen: server {url} does not answer ({getattr(exc, 'reason', exc)}); left out", flush=True
            )
    return found


class Regenerator:
    """Sends conversations to the servers, retrying on the next one after a failure."""

    def __init__(self, settings: RegenSettings, sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self.urls = [base_url(s) for s in settings.servers]
        self.sleep = sleep
        self._next = 0
        self._lock = threading.Lock()

    def _url(self) -> str:
        with self._lock:
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            return url

    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "model": s.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "stream": False,
        }
        if s.reasoning != "none":
            body["chat_template_kwargs"] = {"enable_thinking": s.reasoning == "save"}
        return body

    def _ask(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        return self.send("/v1/chat/completions", self._body(messages))

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` POSTed to ``path`` of the next server, retried on the next one after a failure
        that a retry may mend, with exponential backoff."""
        attempt = 0
        while True:
            try:
                return post(self._url(), path, body, self.settings.timeout_s)
            except RequestError as exc:
                if not exc.retry or attempt >= self.settings.retries:
                    raise
                self.sleep(min(30.0, self.settings.backoff_s * 2**attempt))
                attempt += 1

    def regenerate(self, rid: str, record: dict[str, Any]) -> tuple[str, dict[str, Any], int]:
        """("success" | "error" | "skipped", the line to write, completion tokens)."""
        turns = conversation(record)
        out = dict(record) if isinstance(record, dict) else {"data": record}
        out["_regen_id"] = rid
        if isinstance(turns, str):
            return "skipped", {**out, "status": "skipped", "error": turns}, 0
        sent: list[dict[str, Any]] = []
        tokens = 0
        for turn in turns:
            if turn["role"] == "assistant":
                continue
            sent.append({"role": turn["role"], "content": turn["content"]})
            if turn["role"] != "user":
                continue
            try:
                reply = self._ask(sent)
                message = reply["choices"][0]["message"]
                content = message.get("content")
                if not isinstance(content, str):
                    raise RequestError("bad response", "no message content", False)
            except RequestError as exc:
                return "error", {**out, "status": "error", "error": str(exc), "error_kind": exc.kind}, tokens
            except (KeyError, IndexError, TypeError):
                why = {"error": "bad response: no choices[0].message", "error_kind": "bad response"}
                return "error", {**out, "status": "error", **why}, tokens
            tokens += int((reply.get("usage") or {}).get("completion_tokens") or 0)
            answer: dict[str, Any] = {"role": "assistant", "content": content}
            thought = message.get("reasoning_content")
            if self.settings.reasoning == "save" and isinstance(thought, str):
                answer["reasoning_content"] = thought
            sent.append(answer)
        out.pop("messages", None)
        out.pop("prompt", None)
        out.pop("completion", None)
        out["conversations"] = sent
        out["status"] = "success"
        return "success", out, tokens


class _Progress:
    """A rich bar with ETA and tokens/s on a terminal; elsewhere (a log, ``fab regen``) a line
    every 10 s."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.tokens, self.started = total, done, 0, time.monotonic()
        self._last = 0.0
        self._bar = None
        if sys.stdout.isatty():
            try:
                from rich import progress as bar
            except ImportError:
                return
            self._bar = bar.Progress(
                bar.TextColumn("regen"),
                bar.BarColumn(),
                bar.MofNCompleteColumn(),
                bar.TimeRemainingColumn(),
                bar.TextColumn("{task.fields[rate]} tokens/s"),
            )
            self._bar.start()
            self._task = self._bar.add_task("regen", total=total, completed=done, rate="0")

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        elapsed = time.monotonic() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rate=f"{rate:.0f}")
        elif elapsed - self._last >= 10.0 or self.done == self.total:
            self._last = elapsed
            print(f"regen {self.done}/{self.total} records, {rate:.1f} tokens/s, {elapsed:.0f}s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def regenerate_file(
    input_path: Path,
    output: Path,
    settings: RegenSettings,
    *,
    quiet: bool = False,
    on_done: Callable[[int], None] | None = None,
) -> RegenResult:
    """Regenerate ``input_path`` into ``output`` (+ its error/skipped files), resuming where a
    previous run of the same output stopped. ``on_done(n)``: after each record is written, the
    records done so far (those of an earlier run included), e.g. a ``training.progress`` update."""
    if not input_path.is_file():
        raise ConfigError(f"regen: input {input_path} does not exist")
    if output.resolve() == input_path.resolve():
        raise ConfigError(f"regen: output {output} is the input; give another file")
    error_path, skipped_path = side_paths(output)
    ledgers = (output, error_path, skipped_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    if settings.retry_errors and error_path.is_file():
        error_path.replace(error_path.with_name(error_path.name + ".prev"))
    done = done_ids(ledgers)
    ids = [rid for rid, _ in read_inputs(input_path)]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))  # type: ignore[func-returns-value]
        raise ConfigError(f"regen: {input_path}: id {dup!r} occurs twice; ids must be unique for a resume")
    total = len(ids) if not settings.num_samples else min(len(ids), settings.num_samples)
    todo = [(rid, rec) for rid, rec in read_inputs(input_path) if rid not in done]
    todo = todo[: max(0, total - len(done))]
    regen = Regenerator(settings)
    if todo:
        regen.urls = answering(regen.urls)
        if not regen.urls:
            raise RegenError(
                f"regen: none of the servers answers ({', '.join(settings.servers)}); start them, check "
                "the addresses (as this machine sees them), then run again: nothing was written"
            )
    counts = {"success": 0, "error": 0, "skipped": 0}
    kinds: dict[str, int] = {}
    tokens = 0
    started = time.monotonic()
    progress = None if quiet else _Progress(total, min(len(done), total))
    handles = {name: open(path, "a", encoding="utf-8") for name, path in zip(counts, ledgers, strict=True)}
    limit = settings.concurrency * len(regen.urls)
    try:
        with ThreadPoolExecutor(max_workers=limit) as pool:
            pending: set[Future] = set()
            queue = iter(todo)
            while True:
                for rid, record in queue:
                    pending.add(pool.submit(regen.regenerate, rid, record))
                    if len(pending) >= limit:
                        break
                if not pending:
                    break
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    status, line, used = future.result()
                    handle = handles[status]
                    handle.write(json.dumps(line, ensure_ascii=False) + "\n")
                    handle.flush()
                    counts[status] += 1
                    tokens += used
                    if status == "error":
                        kinds[line.get("error_kind", "?")] = kinds.get(line.get("error_kind", "?"), 0) + 1
                    if progress is not None:
                        progress.update(used)
                    if on_done is not None:
                        on_done(min(len(done), total) + sum(counts.values()))
    finally:
        for handle in handles.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        if progress is not None:
            progress.close()
    totals = {name: _count(path) for name, path in zip(counts, ledgers, strict=True)}
    return RegenResult(
        output=str(output),
        input_records=total,
        success=totals["success"],
        error=totals["error"],
        skipped=totals["skipped"],
        done_before=len(done),
        sent=sum(counts.values()),
        completion_tokens=tokens,
        seconds=round(time.monotonic() - started, 3),
        errors_by_kind=kinds,
    )


def _count(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())
