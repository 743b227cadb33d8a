"""Leave a trainer process without the interpreter's teardown.

A process that has imported torch, transformers and datasets spends 1.3-2 s of CPU after its
last line of work in ``Py_FinalizeEx``: the garbage collector walking every object, then every
module's dict cleared and each object freed one by one (measured on a 2-core VM: ``python -c
"import torch, transformers, datasets"`` 5.6 s, 4.1 s ending in ``os._exit``). A run of many ranks,
evals and exports pays it once a process, on a machine the next process already needs.

``exit_process`` does what the interpreter does before that teardown, in its order, with public
calls, then ends the process: the non-daemon threads are waited for (when any is alive the normal
exit runs instead: only the interpreter's own hook, which runs before the join, can tell an idle
``concurrent.futures`` worker to stop), the ``atexit`` functions run (multiprocessing's joins its
children, wandb's finishes its files), stdout and stderr are flushed, and what is left of the
files this process opened is flushed too (a buffered writer that was never closed keeps its bytes
in a normal exit; ``os._exit`` alone would drop them).
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading

WRITERS = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def other_threads() -> list[threading.Thread]:
    """The live non-daemon threads besides this one (those a normal exit would wait for)."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def _flush(stream: object) -> None:
    try:
        if stream is not None and not getattr(stream, "closed", False):
            stream.flush()  # type: ignore[attr-defined]
    except (OSError, ValueError):
        pass  # a closed or broken pipe: the normal exit would not deliver it either


def exit_process(code: int | None) -> int | None:
    """End the process with ``code`` (None: 0, as ``sys.exit``) after its ``atexit`` functions and
    with its files flushed, skipping the interpreter's teardown; returns ``code`` (for
    ``sys.exit``) when a non-daemon thread is still alive, where only the normal exit is safe."""
    if not isinstance(code, int | None):  # sys.exit prints anything else and exits 1: let it
        return code
    if other_threads() or threading.current_thread() is not threading.main_thread():
        return code
    atexit._run_exitfuncs()
    if other_threads():  # an atexit function started one: let the interpreter see it through
        return code
    # type(), not isinstance(): isinstance reads __class__, which some lazy module proxies answer
    # with a deprecation warning (torch.distributed's) printed at exit
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), WRITERS)]
    for stream in (sys.stdout, sys.stderr, *files):  # the std streams may be wrappers of their own
        _flush(stream)
    os._exit(code or 0)
