"""Run argv lists on a target: this machine, an SSH host, or an LXC container on either.

Layers, innermost first (docs/DESIGN.md "Target"):

1. ``argv`` as given (a list, never a shell string);
2. ``env -C <cwd> -- K=V ... argv`` when a cwd or environment is given (explicit environment,
   never pct's keep-env default);
3. ``pct exec ID -- ...`` or ``lxc-attach -n NAME -- ...`` for a container target;
4. SSH: ``shlex.join`` exactly once, run over one paramiko channel of the target's single
   Fabric ``Connection``. Local: ``subprocess`` with the argv list, no shell at all.

Environment values never reach a log or an error: ``CommandFailed`` shows ``K=***``.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Literal, TextIO

import paramiko
from fabric import Config, Connection

from fleet import known_hosts, remote
from fleet.errors import CommandFailed, ConfigError, DiskFull, TargetError
from fleet.inventory import ENV_KEY_RE, TargetSpec
from fleet.layout import Layout

# The environment every command inside a container starts from (`env -i` + these + the caller's).
CONTAINER_BASE_ENV: dict[str, str] = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}

Where = Literal["container", "host"]
Stdin = bytes | IO[bytes] | Iterable[bytes] | None

CHUNK = 64 * 1024
DEFAULT_IO_TIMEOUT_S = 60.0  # an SSH channel that accepts no bytes for this long is a cut connection
CONNECT_TIMEOUT_S = 10
# After a command exits, how long its output may still drain: a daemon it left holding the pipe
# (e.g. `nohup x &` without redirection) must not hang the task.
DRAIN_S = 10.0
# A dropped link surfaces as TargetError; paramiko's own "Socket exception" log lines would only
# repeat it on stderr (via logging's last-resort handler), so they go nowhere.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# A full disk as commands report it: strerror(ENOSPC) / strerror(EDQUOT), and GNU tar's short write.
DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|tar: .*: Wrote only \d+ of \d+ bytes")
CONTAINER_DOWN_MARKERS = ("not running", "failed to get init pid", "does not exist", "no container")


@dataclass(frozen=True)
class CommandResult:
    """What a command printed and how it exited."""

    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class _Raw:
    exit_code: int
    stdout: str
    stderr: str


def open_target(spec: TargetSpec, *, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> Target:
    """A :class:`Target` for ``spec``; SSH targets connect on first use and keep one connection."""
    if spec.ssh is None:
        return LocalTarget(spec)
    return SshTarget(spec, io_timeout_s=io_timeout_s)


class Target:
    """Runs commands on one target. Use as a context manager, or call :meth:`close`."""

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self.name = spec.name

    @property
    def layout(self) -> Layout:
        return self.spec.layout

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection (nothing to do for local targets)."""

    # --- public API -----------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        check: bool = True,
        timeout: float | None = None,
        stdin: Stdin = None,
        where: Where = "container",
    ) -> CommandResult:
        """Run ``argv`` and capture its output; ``check`` raises ``CommandFailed`` on a non-zero exit."""
        return self._run(argv, env, cwd, check, timeout, stdin, where, stream=False)

    def run_stream(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        check: bool = True,
        timeout: float | None = None,
        stdin: Stdin = None,
        where: Where = "container",
    ) -> CommandResult:
        """Like :meth:`run`, and the output also goes to this terminal as it comes (progress)."""
        return self._run(argv, env, cwd, check, timeout, stdin, where, stream=True)

    def put_tar(self, stream: IO[bytes] | Iterable[bytes], dest_dir: str) -> None:
        """Extract a tar ``stream`` into ``dest_dir`` (created if missing) with one command."""
        self.run(remote.sh("put_tar.sh", dest_dir), stdin=stream)

    def command_for(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        where: Where = "container",
        masked: bool = False,
    ) -> list[str]:
        """The full argv that runs on the host (env wrapper + container wrapper); ``masked`` hides values."""
        if not argv:
            raise ValueError("empty argv")
        cmd = [str(a) for a in argv]
        container = self.spec.container
        in_container = where == "container" and container is not None
        if env or cwd or in_container:
            if "=" in cmd[0]:
                raise ValueError(f"a command name with '=' cannot follow env: {cmd[0]!r}")
            wrapper = ["env"]
            if in_container:
                # Whatever pct/lxc-attach keep (PVE 8 keeps the SSH session's environment, PVE 9
                # clears it), the command inside sees the same fixed environment plus `env`.
                wrapper.append("-i")
            if cwd:
                wrapper += ["-C", cwd]
            wrapper.append("--")  # options end here; K=V assignments follow, then the command
            assignments = {**CONTAINER_BASE_ENV, **(env or {})} if in_container else dict(env or {})
            for key, value in assignments.items():
                if not ENV_KEY_RE.match(key):
                    raise ValueError(f"not an environment variable name: {key!r}")
                shown = "***" if masked and key in (env or {}) else value
                wrapper.append(f"{key}={shown}")
            cmd = [*wrapper, *cmd]
        if where == "container" and container is not None:
            if container.type == "pct":
                cmd = [self.spec.commands.pct, "exec", str(container.id), "--", *cmd]
            else:
                cmd = [self.spec.commands.lxc_attach, "-n", str(container.name), "--", *cmd]
        return cmd

    # --- shared machinery -----------------------------------------------------------------------

    def _exec(self, argv: list[str], stdin: Stdin, timeout: float | None, stream: bool) -> _Raw:
        raise NotImplementedError

    def _run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        cwd: str | None,
        check: bool,
        timeout: float | None,
        stdin: Stdin,
        where: Where,
        *,
        stream: bool,
    ) -> CommandResult:
        full = self.command_for(argv, env=env, cwd=cwd, where=where)
        raw = self._exec(full, stdin, timeout, stream)
        result = CommandResult(tuple(str(a) for a in argv), raw.exit_code, raw.stdout, raw.stderr)
        if raw.exit_code == 0:
            return result
        in_container = where == "container" and self.spec.container is not None
        if in_container:
            suspicious = any(m in raw.stderr.lower() for m in CONTAINER_DOWN_MARKERS)
            if check or suspicious or raw.exit_code == 255:
                self._check_container()
        if not check:
            return result
        # What the user can act on: the command (a shipped script by its name), its cwd and env
        # (values masked), not the container and environment wrappers around it.
        shown = self.command_for(_display(argv), env=env, cwd=cwd, where="host", masked=True)
        stderr = scrub(raw.stderr or raw.stdout, env)
        if DISK_FULL.search(stderr):
            where = self.spec.display
            raise DiskFull(self.name, shown, raw.exit_code, stderr, where, self.spec.workdir)
        raise CommandFailed(self.name, shown, raw.exit_code, stderr, self._hint(argv, raw.exit_code))

    def _hint(self, argv: Sequence[str], exit_code: int) -> str:
        if exit_code in (126, 127):
            return (
                f"is `{argv[0]}` installed on {self.spec.display}? "
                f"command paths are set in [targets.{self.name}.commands]"
            )
        if exit_code == 125 and argv:
            return "env could not start the command (does the working directory exist?)"
        return ""

    def _check_container(self) -> None:
        """Raise ``TargetError`` when the target's container is down or missing, else return."""
        container = self.spec.container
        assert container is not None
        cmds = self.spec.commands
        if container.type == "pct":
            probe = [cmds.pct, "status", str(container.id)]
            start = f"pct start {container.id}"
        else:
            probe = [cmds.lxc_info, "-n", str(container.name), "-s"]
            start = f"lxc-start -n {container.name}"
        raw = self._exec(probe, None, 30.0, False)
        text = " ".join((raw.stdout + " " + raw.stderr).split())
        if raw.exit_code != 0:
            raise TargetError(
                f"{self.name}: {container.display} is not usable on {self.spec.display}: "
                f"`{shlex.join(probe)}` exited {raw.exit_code}: {text[:200]}; "
                f"check targets.{self.name}.container"
            )
        if "running" not in text.lower():
            raise TargetError(
                f"{self.name}: {container.display} is not running on {self.spec.display} ({text[:100]}); "
                f"start it with `{start}`"
            )


class LocalTarget(Target):
    """This machine: ``subprocess`` with argv lists, no shell."""

    def _exec(self, argv: list[str], stdin: Stdin, timeout: float | None, stream: bool) -> _Raw:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # so a timeout can stop the whole process group
            )
        except FileNotFoundError:
            return _Raw(127, "", f"{argv[0]}: command not found")
        except PermissionError:
            return _Raw(126, "", f"{argv[0]}: permission denied")
        assert proc.stdout is not None and proc.stderr is not None
        # read1: whatever is there now (read(n) would wait for n bytes: no progress, no partial output)
        out = _Collector(proc.stdout.read1, sys.stdout if stream else None)
        err = _Collector(proc.stderr.read1, sys.stderr if stream else None)
        writer = None
        if stdin is not None:
            assert proc.stdin is not None
            writer = threading.Thread(target=_feed_pipe, args=(proc.stdin, stdin), daemon=True)
            writer.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TargetError(
                f"{self.name}: `{shlex.join(argv)[:120]}` did not finish within {timeout:g}s; it was stopped"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        if writer is not None:
            writer.join(_drain_s())
        out.join(_drain_s())
        err.join(_drain_s())
        if writer is not None and isinstance(getattr(writer, "error", None), _StdinError):
            raise writer.error.cause  # type: ignore[attr-defined]
        return _Raw(code, out.text(), err.text())


class SshTarget(Target):
    """An SSH host (and maybe its container): one Fabric Connection for the Target's lifetime."""

    def __init__(self, spec: TargetSpec, *, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> None:
        super().__init__(spec)
        assert spec.ssh is not None
        self.ssh = spec.ssh
        self.io_timeout_s = io_timeout_s
        self._conn: Connection | None = None

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
                conn.close()

    def connection(self) -> Connection:
        """The open Fabric Connection (connects on first use, host key checked)."""
        if self._conn is not None and self._conn.is_connected:
            return self._conn
        self.close()  # a stale connection, if any
        ssh = self.ssh
        connect_kwargs: dict[str, object] = {"banner_timeout": CONNECT_TIMEOUT_S}
        if ssh.identity_file:
            self._check_identity_file(ssh.identity_file)
            connect_kwargs.update(key_filename=[ssh.identity_file], look_for_keys=False, allow_agent=False)
        conn = Connection(
            host=ssh.hostname,
            user=ssh.user,
            port=ssh.port,
            config=Config(ssh_config=paramiko.SSHConfig()),  # no ~/.ssh/config: the inventory says all
            connect_timeout=CONNECT_TIMEOUT_S,
            connect_kwargs=connect_kwargs,
        )
        trust = self._load_host_keys(conn.client)
        try:
            conn.open()
        except _HostKeyRefused as err:
            raise TargetError(str(err)) from None
        except paramiko.BadHostKeyException as err:
            raise TargetError(self._bad_key_message(trust, err.key)) from None
        except paramiko.AuthenticationException as err:
            raise TargetError(
                f"{self.name}: authentication failed for {ssh.display} ({err}); check "
                f"targets.{self.name}.identity_file ({ssh.identity_file or 'default keys'}) "
                "and the host's authorized_keys"
            ) from None
        except (paramiko.ssh_exception.NoValidConnectionsError, OSError) as err:
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise TargetError(
                f"{self.name}: cannot reach {ssh.display} ({reason}); check that the host is up "
                f"and targets.{self.name}.host"
            ) from None
        except paramiko.SSHException as err:
            raise TargetError(f"{self.name}: SSH to {ssh.display} failed: {err}") from None
        transport = conn.client.get_transport()
        if transport is not None:
            transport.set_keepalive(15)
        self._conn = conn
        return conn

    def _check_identity_file(self, path: str) -> None:
        """A missing or unreadable key file is the inventory's fault, not the network's: say so."""
        key = f"targets.{self.name}.identity_file"
        if not os.path.exists(path):
            raise ConfigError(f"{self.name}: {key} = {path}: no such file; point it at your private key")
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"{self.name}: {key} = {path}: not a readable file; fix the path or its mode")

    def _load_host_keys(self, client: paramiko.SSHClient) -> known_hosts.Lookup:
        """Trust exactly what the inventory's known_hosts file trusts for this host (read as ssh
        reads it: fleet.known_hosts); a host it does not know is refused, or with accept-new
        added to the file as one line, as ssh does."""
        ssh = self.ssh
        path = ssh.known_hosts
        if ssh.host_key_policy == "accept-new" and not os.path.exists(path):
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            with open(path, "a"):
                os.chmod(path, 0o600)
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except FileNotFoundError:
            text = ""
        except OSError as err:
            raise TargetError(
                f"{self.name}: cannot read known_hosts {path}: {err.strerror}; "
                f"fix targets.{self.name}.known_hosts"
            ) from None
        trust = known_hosts.lookup(known_hosts.parse(text), known_hosts.host_string(ssh.hostname, ssh.port))
        name = ssh.hostname if ssh.port == 22 else f"[{ssh.hostname}]:{ssh.port}"  # paramiko's lookup key
        for _lineno, key in trust.keys:
            client.get_host_keys().add(name, key.get_name(), key)
        client.set_missing_host_key_policy(_HostKeyPolicy(self, trust))
        return trust

    def _host_pattern(self) -> str:
        ssh = self.ssh
        return ssh.hostname if ssh.port == 22 else f"[{ssh.hostname}]:{ssh.port}"

    def _revoked_message(self, trust: known_hosts.Lookup, key: paramiko.PKey) -> str | None:
        line = trust.revoked_line(key)
        if line is None:
            return None
        return (
            f"{self.name}: the host key of {self.ssh.display} is revoked by {self.ssh.known_hosts} line "
            f"{line} (@revoked); refusing to connect: ask the host's admin for its new key"
        )

    def _bad_key_message(self, trust: known_hosts.Lookup, key: paramiko.PKey | None = None) -> str:
        revoked = self._revoked_message(trust, key) if key is not None else None
        if revoked:
            return revoked
        kh = self.ssh.known_hosts
        lines = ", ".join(str(n) for n, _ in trust.keys)
        where = f" (line {lines})" if lines else ""
        return (
            f"{self.name}: the host key of {self.ssh.display} does not match {kh}{where} (possible "
            f"attack, or a reinstalled host); if expected, remove the old key: "
            f"ssh-keygen -R '{self._host_pattern()}' -f {kh}"
        )

    def _unknown_key_message(self, trust: known_hosts.Lookup) -> str:
        ssh = self.ssh
        kh = ssh.known_hosts
        add = f"ssh-keyscan -p {ssh.port} {ssh.hostname} >> {kh}"
        if trust.cert_authorities:
            return (
                f"{self.name}: {kh} line {trust.cert_authorities[0]} vouches for {ssh.display} with "
                "@cert-authority (host certificates), which fleet's SSH client (paramiko) cannot check; "
                f"verify the host's own key and add it ({add})"
            )
        if trust.unsupported:
            lineno, why = trust.unsupported[0]
            return (
                f"{self.name}: {kh} line {lineno} is for {ssh.display} but fleet cannot use it ({why}); "
                f"verify the host's key and add a supported one ({add})"
            )
        missing = "" if os.path.exists(kh) else " (the file does not exist)"
        return (
            f"{self.name}: the host key of {ssh.display} is not in {kh}{missing}; verify it and add it "
            f'({add}) or set targets.{self.name}.host_key_policy = "accept-new"'
        )

    def _lost(self, doing: str) -> TargetError:
        return TargetError(
            f"{self.name}: connection to {self.ssh.display} lost {doing}; check the network and retry"
        )

    def _send_stdin(self, chan: paramiko.Channel, transport: paramiko.Transport, stdin: Stdin) -> None:
        """Stream ``stdin`` into the channel, then EOF; a dead link raises instead of hanging."""
        chunks = _chunks(stdin)
        while True:
            chunk = next(chunks, None)  # a failing producer raises here, as itself
            if chunk is None:
                break
            try:
                chan.sendall(chunk)
            except (OSError, EOFError, paramiko.SSHException):
                # The command may have exited early (its exit code says why) or the link died.
                chan.status_event.wait(2.0)
                if chan.exit_status < 0 or not transport.is_active():
                    self.close()
                    raise self._lost("while sending data") from None
                return
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            chan.shutdown_write()

    def _exec(self, argv: list[str], stdin: Stdin, timeout: float | None, stream: bool) -> _Raw:
        transport = self.connection().client.get_transport()
        if transport is None or not transport.is_active():
            self.close()
            raise self._lost("before the command started")
        command = shlex.join(argv)
        try:
            chan = transport.open_session(timeout=CONNECT_TIMEOUT_S)
            chan.settimeout(self.io_timeout_s)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError):
            self.close()
            raise self._lost("while starting a command") from None
        with contextlib.closing(chan):
            out = _Collector(_chan_reader(chan.recv, chan, transport), sys.stdout if stream else None)
            err = _Collector(_chan_reader(chan.recv_stderr, chan, transport), sys.stderr if stream else None)
            self._send_stdin(chan, transport, stdin)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not chan.status_event.wait(0.5):
                if not transport.is_active():
                    self.close()
                    raise self._lost("while a command ran")
                if deadline is not None and time.monotonic() > deadline:
                    raise TargetError(
                        f"{self.name}: `{command[:120]}` did not finish within {timeout:g}s; "
                        "its channel was closed"
                    )
            if chan.exit_status < 0:
                self.close()
                raise self._lost("before the command reported its exit status")
            out.join(_drain_s())
            err.join(_drain_s())
            return _Raw(chan.exit_status, out.text(), err.text())


class _HostKeyRefused(paramiko.SSHException):
    """A host key refused by the known_hosts rules; its message is the user's one line."""


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko when the server's key is not among the trusted keys of the host."""

    def __init__(self, target: SshTarget, trust: known_hosts.Lookup) -> None:
        self.target = target
        self.trust = trust

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        revoked = self.target._revoked_message(self.trust, key)
        if revoked:
            raise _HostKeyRefused(revoked)
        ssh = self.target.ssh
        if ssh.host_key_policy != "accept-new":
            raise _HostKeyRefused(self.target._unknown_key_message(self.trust))
        # accept-new, as ssh does it: a host with no key on file gets its key appended.
        try:
            with open(ssh.known_hosts, "a", encoding="utf-8") as fh:
                fh.write(known_hosts.new_line(self.trust.host, key))
        except OSError as err:
            raise _HostKeyRefused(
                f"{self.target.name}: cannot add the host key of {ssh.display} to {ssh.known_hosts}: "
                f"{err.strerror}; fix targets.{self.target.name}.known_hosts"
            ) from None


# --- helpers --------------------------------------------------------------------------------------


class _StdinError:
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Collector:
    """Reads a byte source in a thread, keeps the text, optionally echoes it to a terminal stream."""

    def __init__(self, read: Callable[[int], bytes], echo: TextIO | None) -> None:
        self._read = read
        self._echo = echo
        self._parts: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            data = self._read(CHUNK)
            if not data:
                break
            self._emit(self._decoder.decode(data))
        self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        if self._echo is not None:
            self._echo.write(text)
            self._echo.flush()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        return "".join(list(self._parts))


def _chan_reader(
    recv: Callable[[int], bytes], chan: paramiko.Channel, transport: paramiko.Transport
) -> Callable[[int], bytes]:
    """A ``read`` for :class:`_Collector` that waits through quiet periods until EOF or a dead link."""

    def read(size: int) -> bytes:
        while True:
            try:
                return recv(size)
            except TimeoutError:
                if chan.closed or not transport.is_active():
                    return b""
            except (OSError, EOFError, paramiko.SSHException):
                return b""

    return read


def _chunks(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return
    if isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]
        return
    read = getattr(stdin, "read", None)
    if read is not None:
        while chunk := read(CHUNK):
            yield chunk
        return
    yield from stdin  # type: ignore[misc]


def _feed_pipe(pipe: IO[bytes], stdin: Stdin) -> None:
    thread = threading.current_thread()
    try:
        for chunk in _chunks(stdin):
            pipe.write(chunk)
    except BrokenPipeError:
        pass  # the command exited early; its exit code and stderr say why
    except BaseException as err:  # the producer failed: surface it from the caller's thread
        thread.error = _StdinError(err)  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(BrokenPipeError):
            pipe.close()


def _display(argv: Sequence[str]) -> list[str]:
    """``sh -c <script> fleet-<name> ARGS`` (a shipped script) shown as ``fleet-<name> ARGS``."""
    cmd = [str(a) for a in argv]
    if len(cmd) >= 4 and cmd[:2] == ["sh", "-c"] and cmd[3].startswith("fleet-"):
        return cmd[3:]
    return cmd


def _drain_s() -> float:
    return DRAIN_S  # looked up at call time, so tests can shorten it


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def scrub(text: str, env: Mapping[str, str] | None) -> str:
    """``text`` with every environment value of the command replaced by ``***``."""
    for value in sorted((env or {}).values(), key=len, reverse=True):
        if len(value) >= 3:
            text = text.replace(value, "***")
    return text


__all__ = ["CommandResult", "LocalTarget", "SshTarget", "Target", "open_target", "scrub"]
