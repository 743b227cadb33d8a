"""Progress of a long phase, reported at a steady cadence, and stopping in any phase.

A phase that can take minutes (converting the GGUF, regenerating the data, tokenizing, loading the
target, compiling, evaluating, writing a checkpoint) wraps its work in ``Progress``: the work calls
``update(done)`` as units complete (replies, records, shapes, tokens), and a background thread
writes a ``progress`` event every ``every_s`` seconds (and one at the start and the end) whether or
not a unit completed since the last one. Progresses nest: a phase opens one over its whole span
(so it reports from its first second, before any stage of it reports), and while a stage's own
``Progress`` runs inside it only the innermost beats. ``fab status`` shows the phase's fraction and ETA from
those events, and its stall detection sees a phase that reports as alive, however long one unit
takes. The cadence is by time, not by units: a unit of minutes still gives an event every
``every_s``.

Stopping. SIGTERM/SIGINT set a flag that the training loop reads between steps (a step is never cut
in half: its checkpoint must be consistent). Outside the step loop nothing is lost by leaving at
once, so while ``stop_anywhere`` is in force the handler raises ``StopRequested`` in the main
thread (as SIGINT raises KeyboardInterrupt): a phase stops within the Python statement it is in.
It derives from BaseException so that no library's ``except Exception`` swallows it. Files those
phases write are written aside and renamed (the converted model, the regenerated data, the
tokenized cache, checkpoints), so a stop leaves no half file in their place.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

PROGRESS_EVERY_S = 10.0  # the cadence of progress events: well inside fleet's stall window (600 s)
ECHO_EVERY_S = 30.0  # the cadence of the human log line of a phase's progress


class StopRequested(BaseException):
    """SIGTERM/SIGINT arrived outside the step loop: the run stops where it is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Sink:
    """Where this process's progress goes (``report_to``); nowhere until a trainer says."""

    emit: Callable[..., Any] | None = None
    echo: Callable[[str], None] | None = None


_sink = _Sink()
_open: list[Progress] = []  # the Progresses entered and not yet left, innermost last
_open_lock = threading.Lock()


def report_to(events: Any | None, echo: Callable[[str], None] | None = None) -> None:
    """Send this process's ``Progress`` to ``events`` (an EventWriter: ``progress`` events) and
    ``echo`` (human lines); ``None`` turns it off."""
    _sink.emit = (lambda **fields: events.emit("progress", **fields)) if events is not None else None
    _sink.echo = echo


class Progress:
    """``done`` of ``total`` ``unit`` of one phase, reported by a background thread (module docstring).

    ``emit(**fields)`` writes the ``progress`` event; ``echo`` gets a human line every
    ``echo_every_s``. Both default to the process's (``report_to``): code deep in the data and
    model set-up reports progress without an event writer passed down to it. Without either it
    only counts. Use as a context manager.
    """

    def __init__(
        self,
        phase: str,
        what: str,
        total: float,
        unit: str,
        *,
        emit: Callable[..., Any] | None = None,
        echo: Callable[[str], None] | None = None,
        every_s: float = PROGRESS_EVERY_S,
        echo_every_s: float = ECHO_EVERY_S,
    ) -> None:
        self._emit = emit or _sink.emit
        echo = echo or _sink.echo
        self.phase = phase
        self.what = what
        self.total = float(total)
        self.unit = unit
        self.done = 0.0
        self._echo = echo
        self._every_s = every_s
        self._echo_every_s = echo_every_s
        self._started = time.monotonic()
        self._last_echo = self._started
        self._echoed = -1.0  # ``done`` at the last human line: a line only when it moved
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, done: float) -> None:
        """``done`` units are complete (cumulative)."""
        self.done = min(float(done), self.total) if self.total > 0 else float(done)

    def advance(self, units: float = 1.0) -> None:
        self.update(self.done + units)

    def fields(self) -> dict[str, Any]:
        """The ``progress`` event's fields now."""
        seconds = time.monotonic() - self._started
        rate = self.done / seconds if seconds > 0 else 0.0
        return {
            "phase": self.phase,
            "what": self.what,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "rate": rate,
            "seconds": seconds,
        }

    def line(self) -> str:
        """``load_data: regenerating replies 48/144 (33%) in 61s, ETA 2m07s``."""
        f = self.fields()
        pct = f" ({100 * f['done'] / f['total']:.0f}%)" if f["total"] > 0 else ""
        eta = (f["total"] - f["done"]) / f["rate"] if f["rate"] > 0 and f["total"] > 0 else None
        left = f", ETA {duration(eta)}" if eta is not None else ""
        return (
            f"{self.phase}: {self.what} {f['done']:.0f}/{f['total']:.0f} {self.unit}{pct}"
            f" in {duration(f['seconds'])}{left}"
        )

    def report(self, *, force_echo: bool = False) -> None:
        with self._lock:
            if self._emit is not None:
                self._emit(**self.fields())
            now = time.monotonic()
            due = now - self._last_echo >= self._echo_every_s and self.done != self._echoed
            if self._echo is not None and (force_echo or due):
                self._last_echo, self._echoed = now, self.done
                self._echo(self.line())

    def _beat(self) -> None:
        while not self._finished.wait(self._every_s):
            with _open_lock:
                innermost = not _open or _open[-1] is self
            if innermost:  # an outer one waits while a stage inside it reports its own fraction
                self.report()

    def __enter__(self) -> Progress:
        with _open_lock:
            _open.append(self)
        self.report()
        self._thread = threading.Thread(target=self._beat, name=f"progress-{self.phase}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        self._finished.set()
        if self._thread is not None:
            self._thread.join()
        with _open_lock:
            if self in _open:
                _open.remove(self)
        if exc_type is None:
            self.update(self.total if self.total > 0 else self.done)
            self.report(force_echo=self._echo is not None and self.done > 0)


def duration(seconds: float | None) -> str:
    """``45s``, ``2m07s``, ``3h05m``."""
    if seconds is None:
        return "?"
    s = int(max(0.0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class StopSignals:
    """SIGTERM/SIGINT for a trainer: a flag the step loop reads (``requested``), and, inside
    ``anywhere()``, ``StopRequested`` raised where the main thread is."""

    def __init__(self, on_signal: Callable[[int], None] = lambda _signum: None) -> None:
        self.requested: int | None = None
        self._anywhere = 0
        self._previous: dict[int, Any] = {}
        self._on_signal = on_signal

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        first = self.requested is None
        self.requested = signum
        if first:
            self._on_signal(signum)
        if self._anywhere:
            raise StopRequested(signum)

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextmanager
    def anywhere(self) -> Iterator[None]:
        """Inside: a stop signal raises ``StopRequested`` at once (also one that came before)."""
        if self.requested is not None:
            raise StopRequested(self.requested)
        self._anywhere += 1
        try:
            yield
        finally:
            self._anywhere -= 1
