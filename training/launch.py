"""``python -m training.launch ARGS``: torchrun with the same ARGS, made fit for fleet's runs.

A stop (SIGTERM/SIGINT from `fab stop`) is exit 0, not a failure; a single node rendezvouses over
loopback, never its hostname; a rendezvous that cannot form is one line, exit 1. The ranks it
starts join their process groups in ``training.topology``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

LOOPBACK = "127.0.0.1"


def loopback_rendezvous(args: Any) -> bool:
    """Point a single-node torchrun (parsed ``args``) at a rendezvous on 127.0.0.1; False when
    the arguments name a multi-node rendezvous, which is left as given.

    torchrun's own single-node default (``--standalone``, or no rendezvous at all) is c10d on
    ``localhost:0`` with every node advertised by its hostname: where the hostname does not
    resolve (a fresh debootstrapped container, some LXC containers have no /etc/hosts line for
    it) the workers retry ``<hostname>:port`` forever. Here the store listens on 127.0.0.1 (port
    0: the kernel picks a free one), the node advertises 127.0.0.1 (``--local-addr``), and gloo
    binds the loopback interface, so nothing depends on name resolution.
    """
    from torch.distributed.run import parse_min_max_nnodes

    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    named = bool(args.rdzv_endpoint) or args.master_port is not None or args.rdzv_backend != "static"
    if not args.standalone and (max_nodes != 1 or named):
        return False
    args.standalone = False
    args.nnodes = "1"
    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = f"{LOOPBACK}:0"
    args.rdzv_id = f"fleet-{os.getpid()}"
    args.local_addr = LOOPBACK
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # inherited by the ranks
    return True


def _endpoint(args: Any) -> str:
    return args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"


def unresolvable_endpoint(args: Any) -> str:
    """One line when the rendezvous endpoint's host does not resolve here, else "" (checked before
    torchrun starts: its store client would retry the name for minutes, warning each time)."""
    host = _endpoint(args).rsplit(":", 1)[0].strip("[]")
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        return (
            f"torchrun: the rendezvous host {host!r} does not resolve on {socket.gethostname()} ({exc}): "
            "give its IP address in --rdzv-endpoint, or add it to /etc/hosts (or DNS) on every node"
        )
    return ""


def rendezvous_failure(exc: BaseException, args: Any) -> str:
    """One line for a rendezvous that could not form: where, within what time, what to check. Pure."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    endpoint = _endpoint(args)
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    causes = [exc, *([exc.__cause__] if exc.__cause__ is not None else [])]
    what = (
        "; ".join((str(e).strip().splitlines() or [type(e).__name__])[0] for e in causes if str(e).strip())
        or type(exc).__name__
    )
    if isinstance(exc, RendezvousTimeoutError):
        timeout = conf.get("join_timeout", "600")
        return (
            f"torchrun: the rendezvous at {endpoint} did not form within {timeout} s ({args.nnodes} "
            f"nodes expected; {what}): start the same command on every node (--node-rank 0..N-1) and "
            f"check that each reaches {endpoint} (hostname resolution, firewall); "
            "--rdzv-conf=join_timeout=S sets the wait"
        )
    return (
        f"torchrun: cannot reach the rendezvous at {endpoint} ({what}): check that node 0 is started "
        "and that its port is open from every node"
    )


def launch(argv: list[str]) -> int:
    """``python -m training.launch ARGS``: torchrun with the same ARGS, for which SIGTERM/SIGINT
    is a stop, not a failure, a single node rendezvouses over loopback (``loopback_rendezvous``)
    and a rendezvous that cannot form is one line (``rendezvous_failure``), exit 1.

    ``fab stop`` signals the run's process group: every rank gets SIGTERM, finishes its step,
    the drafters checkpoint and every rank writes ``phase: stopped`` and exits 0; torchrun itself
    raises ``SignalException`` after stopping its workers (waiting up to 30 s, then SIGKILL), which
    would make the run's exit code 1 ("failed"). Here that is exit 0; a worker failure
    (``ChildFailedError``) still exits non-zero.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    if not loopback_rendezvous(args):
        unresolved = unresolvable_endpoint(args)
        if unresolved:
            print(unresolved, file=sys.stderr, flush=True)
            return 1
    try:
        record(run)(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"torchrun: {name}: the ranks were asked to checkpoint and stop", file=sys.stderr, flush=True)
    except RendezvousError as exc:
        print(rendezvous_failure(exc, args), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from training.process_exit import exit_process

    sys.exit(exit_process(launch(sys.argv[1:])))
