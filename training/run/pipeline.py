"""The wire between target and drafter ranks: messages, backpressure, peer loss, balance.

Per (target t, drafter d) pair there are two 2-rank groups (training.topology): ``ctl``
(gloo, small CPU tensors) and ``data`` (NCCL on GPU, gloo on CPU; the payloads). One batch
travels as:

    t -> d  ctl   header  int64[HEADER_LEN]: kind, seq, epoch, index, bucket, B, T, K, F, dtype
    t -> d  data  meta    int64[2*B*T + B + B*K]: input_ids | loss_mask | lengths | anchors
    t -> d  data  hidden  [B, T, F] (bf16 on GPU)
    d -> t  ctl   credit  int64[1]: CREDIT (a slot is free again), STOP_DONE or STOP_SIGNAL

A target holds ``credits`` slots per drafter and only produces a batch when some drafter
has one free: however uneven the rates, at most ``credits`` batches per pair are in flight
(memory stays bounded). The header goes first so the drafter can size its receive buffers.
After a STOP the target sends an END header and nothing more on that pair.

Blocking receives and sends run in small helper threads (one per peer), which report into a
``queue.Queue``: gloo's ``Work.is_completed`` never turns true when the peer dies, while
``wait()`` raises at once ("Connection closed by peer") or after the group timeout. The
threads only move bytes; no model code (and no torch.compile) runs in them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from training.config import TrainingError
from training.events import EventWriter, first_line

HEADER_LEN = 10
KIND_BATCH, KIND_END = 1, 2
CREDIT, STOP_DONE, STOP_SIGNAL = 1, -1, -2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RankLost(TrainingError):
    """A peer rank died, hung past the timeout, or broke the protocol (exit 3); ``peer``: its rank."""

    exit_code = 3

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(frozen=True)
class Header:
    kind: int
    seq: int  # global batch number
    epoch: int
    index: int
    bucket: int
    batch: int  # B
    length: int  # T
    anchors: int  # K
    features: int  # F
    dtype: torch.dtype

    def to_tensor(self) -> torch.Tensor:
        values = [self.kind, self.seq, self.epoch, self.index, self.bucket]
        values += [self.batch, self.length, self.anchors, self.features, DTYPES.index(self.dtype)]
        return torch.tensor(values, dtype=torch.long)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Header:
        v = [int(x) for x in tensor.tolist()]
        return cls(*v[:9], dtype=DTYPES[v[9]])

    @classmethod
    def end(cls) -> Header:
        return cls(KIND_END, -1, 0, 0, 0, 0, 0, 0, 0, torch.float32)

    @property
    def meta_numel(self) -> int:
        return 2 * self.batch * self.length + self.batch + self.batch * self.anchors


@dataclass(frozen=True)
class WorkItem:
    """One batch with its target hidden states, as a drafter trains on it."""

    seq: int
    epoch: int
    index: int
    bucket: int
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B] long
    anchors: torch.Tensor  # [B, K] long, -1 padded
    hidden: torch.Tensor  # [B, T, F]

    def header(self) -> Header:
        b, t = self.input_ids.shape
        return Header(
            KIND_BATCH,
            self.seq,
            self.epoch,
            self.index,
            self.bucket,
            b,
            t,
            self.anchors.shape[1],
            self.hidden.shape[-1],
            self.hidden.dtype,
        )

    def meta(self) -> torch.Tensor:
        parts = [self.input_ids, self.loss_mask.long(), self.lengths.to(self.input_ids.device), self.anchors]
        return torch.cat([p.reshape(-1).long() for p in parts])


def unpack(header: Header, meta: torch.Tensor, hidden: torch.Tensor) -> WorkItem:
    b, t, k = header.batch, header.length, header.anchors
    ids, mask, lengths, anchors = meta.split([b * t, b * t, b, b * k])
    return WorkItem(
        seq=header.seq,
        epoch=header.epoch,
        index=header.index,
        bucket=header.bucket,
        input_ids=ids.view(b, t),
        loss_mask=mask.view(b, t).bool(),
        lengths=lengths.cpu(),
        anchors=anchors.view(b, k),
        hidden=hidden,
    )


def send_item(item: WorkItem, dst: int, ctl: Any, data: Any, timeout_s: float) -> None:
    """Header on ``ctl``, then meta and hidden on ``data``; returns once they were handed over.

    NCCL: the sends are polled (``is_completed``), never ``wait()``-ed: ``wait`` would make
    the device's current stream (the one the target forward runs on) wait for the drafter
    to post its receive, stalling the target behind a busy drafter.
    """
    dist.send(item.header().to_tensor(), dst=dst, group=ctl)
    works = [dist.isend(item.meta().contiguous(), dst=dst, group=data)]
    works.append(dist.isend(item.hidden.contiguous(), dst=dst, group=data))
    if not item.hidden.is_cuda:
        for work in works:
            work.wait()
        return
    deadline = time.monotonic() + timeout_s
    while not all(work.is_completed() for work in works):
        if time.monotonic() > deadline:
            raise RuntimeError(f"send of batch {item.seq} not taken within {timeout_s:.0f}s")
        time.sleep(0.0005)


def post_receive(header: Header, src: int, data: Any, device: torch.device) -> Callable[[], WorkItem]:
    """Post the payload receives of ``header``; the returned callable waits and unpacks."""
    meta = torch.empty(header.meta_numel, dtype=torch.long, device=device)
    hidden = torch.empty((header.batch, header.length, header.features), dtype=header.dtype, device=device)
    works = [dist.irecv(meta, src=src, group=data), dist.irecv(hidden, src=src, group=data)]

    def finish() -> WorkItem:
        for work in works:
            work.wait()
        if device.type == "cuda":  # the data is there (honest wait time for `balance`)
            torch.cuda.current_stream(device).synchronize()
        return unpack(header, meta, hidden)

    return finish


@dataclass(frozen=True)
class Message:
    """What a helper thread reports: a value from ``peer``, or the error it hit."""

    peer: int
    kind: str  # "header" | "control" | "error" | "sent"
    value: Any = None


def start_thread(name: str, body: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


def header_receiver(src: int, ctl: Any, out: queue.Queue[Message]) -> Callable[[], None]:
    """Drafter side: receive headers from target ``src`` until END (or an error)."""

    def body() -> None:
        try:
            while True:
                buf = torch.empty(HEADER_LEN, dtype=torch.long)
                dist.recv(buf, src=src, group=ctl)
                header = Header.from_tensor(buf)
                out.put(Message(src, "header", header))
                if header.kind == KIND_END:
                    return
        except RuntimeError as exc:  # gloo: connection closed / timeout
            out.put(Message(src, "error", exc))

    return body


def control_receiver(src: int, ctl: Any, out: queue.Queue[Message]) -> Callable[[], None]:
    """Target side: receive credits from drafter ``src`` until a STOP (or an error)."""

    def body() -> None:
        try:
            while True:
                buf = torch.zeros(1, dtype=torch.long)
                dist.recv(buf, src=src, group=ctl)
                value = int(buf.item())
                out.put(Message(src, "control", value))
                if value < 0:
                    return
        except RuntimeError as exc:
            out.put(Message(src, "error", exc))

    return body


def item_sender(
    dst: int,
    ctl: Any,
    data: Any,
    inbox: queue.Queue[WorkItem | None],
    out: queue.Queue[Message],
    device: torch.device,
    timeout_s: float,
) -> Callable[[], None]:
    """Target side: send the items put in ``inbox`` to drafter ``dst``; ``None`` sends END and ends."""

    def body() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the CUDA current device is per thread
            # A side stream of this thread's own: NCCL's send waits for the current stream,
            # which must not be the default one (it holds the next target forward already).
            torch.cuda.set_stream(torch.cuda.Stream(device))
        try:
            while True:
                item = inbox.get()
                if item is None:
                    dist.send(Header.end().to_tensor(), dst=dst, group=ctl)
                    return
                send_item(item, dst, ctl, data, timeout_s)
                out.put(Message(dst, "sent", item.seq))
        except RuntimeError as exc:
            out.put(Message(dst, "error", exc))

    return body


def send_control(value: int, dst: int, ctl: Any) -> None:
    dist.send(torch.tensor([value], dtype=torch.long), dst=dst, group=ctl)


def next_message(
    inbox: queue.Queue[Message],
    timeout_s: float,
    waiting_for: str,
    describe: Callable[[int], str],
    peer: int | None = None,
) -> Message:
    """The next message, or ``RankLost`` naming the peer that failed / what was awaited
    (``peer``: the one rank awaited, if it is one)."""
    try:
        message = inbox.get(timeout=timeout_s)
    except queue.Empty:
        raise RankLost(f"no message for {timeout_s:.0f}s while waiting for {waiting_for}", peer) from None
    if message.kind == "error":
        raise _lost_peer(message, describe)
    return message


def ready_messages(inbox: queue.Queue[Message], describe: Callable[[int], str]) -> Iterator[Message]:
    """The messages already in the inbox, without waiting; an error among them raises
    ``RankLost`` naming its peer at once (other peers' messages may have queued behind it)."""
    while True:
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return
        if message.kind == "error":
            raise _lost_peer(message, describe)
        yield message


def _lost_peer(message: Message, describe: Callable[[int], str]) -> RankLost:
    """The ``RankLost`` a helper thread's error message stands for: its peer, the error's first line."""
    first = first_line(message.value) or "error"
    return RankLost(f"lost {describe(message.peer)}: {first[:200]}", message.peer)


class Balance:
    """Busy vs waiting time and tokens of one rank; a ``balance`` event per window."""

    def __init__(self, events: EventWriter, window_s: float) -> None:
        self.events = events
        self.window_s = window_s
        self.started = time.monotonic()
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.tokens = 0
        self.total_busy_s = 0.0
        self.total_wait_s = 0.0
        self.total_tokens = 0
        self.first = self.started

    def restart(self) -> None:
        """Start counting now (training begins; set-up time is not part of any window)."""
        self.started = self.first = time.monotonic()
        self.busy_s = self.wait_s = self.total_busy_s = self.total_wait_s = 0.0
        self.tokens = self.total_tokens = 0

    def busy(self, seconds: float, tokens: int = 0) -> None:
        self.busy_s += seconds
        self.tokens += tokens
        self.total_busy_s += seconds
        self.total_tokens += tokens

    def wait(self, seconds: float) -> None:
        self.wait_s += seconds
        self.total_wait_s += seconds

    def maybe_emit(self, force: bool = False) -> dict[str, Any] | None:
        now = time.monotonic()
        window = now - self.started
        if window <= 0 or (window < self.window_s and not force):
            return None
        emitted = self.events.emit(
            "balance",
            window_s=window,
            busy_s=self.busy_s,
            wait_s=self.wait_s,
            tokens_per_s=self.tokens / window,
        )
        self.started, self.busy_s, self.wait_s, self.tokens = now, 0.0, 0.0, 0
        return emitted

    def summary(self) -> dict[str, float]:
        """Totals since start: seconds busy / waiting, tokens, idle fraction."""
        elapsed = max(time.monotonic() - self.first, 1e-9)
        return {
            "elapsed_s": elapsed,
            "busy_s": self.total_busy_s,
            "wait_s": self.total_wait_s,
            "tokens": float(self.total_tokens),
            "idle_fraction": self.total_wait_s / elapsed,
        }


__all__ = [
    "CREDIT",
    "KIND_BATCH",
    "KIND_END",
    "STOP_DONE",
    "STOP_SIGNAL",
    "Balance",
    "Header",
    "Message",
    "RankLost",
    "WorkItem",
    "control_receiver",
    "header_receiver",
    "item_sender",
    "next_message",
    "post_receive",
    "ready_messages",
    "send_control",
    "send_item",
    "start_thread",
    "unpack",
]
