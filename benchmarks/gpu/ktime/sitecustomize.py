"""Per-kernel Triton compile times, for ``benchmarks/cold_bench.py`` (on ``PYTHONPATH`` only there).

Wraps ``triton.compile`` in every Python process that starts with ``FLEET_KERNEL_LOG`` set,
inductor's compile workers included (they inherit the environment), and appends one line per
compiled kernel to that file: ``<seconds>\\t<kernel name>\\t<pid>``.
"""

import os

_LOG = os.environ.get("FLEET_KERNEL_LOG")
if _LOG:
    try:
        import time

        import triton

        _compile = triton.compile

        def _timed_compile(src, *args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return _compile(src, *args, **kwargs)
            finally:
                name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
                with open(_LOG, "a") as fh:
                    fh.write(f"{time.perf_counter() - started:.3f}\t{name}\t{os.getpid()}\n")

        triton.compile = _timed_compile
    except ImportError:
        pass
