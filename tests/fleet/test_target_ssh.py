"""The SSH target against the real test host (sshd on 127.0.0.1 + LXC container 200 behind the
pct shim): literal argv through two shell-free layers, binary stdin, one tar stream, one
connection per target, and a link that is cut or stalls mid-stream (a real TCP relay between
fleet and sshd) surfacing as TargetError instead of a hang."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import CommandFailed, TargetError
from fleet.inventory import Commands, ContainerSpec, SshSpec, TargetSpec
from fleet.target import SshTarget, open_target

pytestmark = pytest.mark.hosts


def spec(
    hosts: Any, *, port: int | None = None, known_hosts: str | None = None, container: bool = True
) -> TargetSpec:
    return TargetSpec(
        name="ct",
        host=f"{hosts.ssh_user}@{hosts.ssh_host}:{port or hosts.ssh_port}",
        workdir="/tmp/fleet-target-test",
        ssh=SshSpec(
            user=hosts.ssh_user,
            hostname=hosts.ssh_host,
            port=port or hosts.ssh_port,
            identity_file=hosts.identity,
            known_hosts=known_hosts or hosts.known_hosts,
        ),
        container=ContainerSpec("pct", id=hosts.ct_id) if container else None,
        commands=Commands(pct=hosts.pct),
    )


class Relay:
    """A TCP relay 127.0.0.1:<port> -> sshd that can cut (close) or stall (stop forwarding) the link."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.forwarded = 0
        self.cut_after: int | None = None  # close both sides once this many bytes went upstream
        self.stall_after: int | None = None  # stop forwarding (keep sockets open) after this many
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if upstream:
                self.forwarded += len(data)
                if self.stall_after is not None and self.forwarded > self.stall_after:
                    threading.Event().wait(3600)  # black hole: hold everything, close nothing
                if self.cut_after is not None and self.forwarded > self.cut_after:
                    self.close()
                    return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for sock in [self.listener, *self.sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@pytest.fixture
def relay(hosts: Any, tmp_path: Path) -> Iterator[tuple[Relay, str]]:
    relay = Relay((hosts.ssh_host, hosts.ssh_port))
    # The relay serves sshd's own host key: known_hosts lists it under the relay's port.
    key = Path(hosts.known_hosts).read_text().split("\n")[0].split(None, 1)[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{relay.port} {key}\n")
    yield relay, str(known)
    relay.close()


def raises_without_hanging(call: Callable[[], object], limit_s: float = 300) -> BaseException:
    """Run ``call`` in a thread; what it raised. A hang fails the test instead of blocking CI."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            call()
        except BaseException as err:  # handed to the test thread
            raised.append(err)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still blocked after {limit_s:g}s: the dead link was not noticed"
    assert raised, "the call returned although the link died"
    return raised[0]


def markers_absent(hosts: Any, marker: str) -> None:
    assert not Path("/tmp", marker).exists(), "a hostile string ran on the host"
    assert not (Path(hosts.ct_rootfs) / "tmp" / marker).exists(), "a hostile string ran in the container"


def test_hostile_argv_env_and_cwd_are_literal_through_ssh_and_pct(hosts: Any) -> None:
    marker = f"fleet-marker-{uuid.uuid4().hex[:8]}"
    hostile = [
        f"a;touch /tmp/{marker}",
        f"$(touch /tmp/{marker})",
        f"`touch /tmp/{marker}`",
        "'\"",
        "x y",
        "",
    ]
    secret = f"s3cret $(touch /tmp/{marker}) 'q\""
    with open_target(spec(hosts)) as target:
        result = target.run(["printf", "%s\\0", *hostile])
        assert result.stdout == "\0".join(hostile) + "\0"
        shown = target.run(["sh", "-c", 'printf "%s" "$S"; pwd'], env={"S": secret}, cwd="/tmp")
        assert shown.stdout == f"{secret}/tmp\n"
        with pytest.raises(CommandFailed) as info:
            target.run(["sh", "-c", 'echo "$S" >&2; exit 9'], env={"S": secret})
    assert secret not in str(info.value) and "S=***" in str(info.value)
    assert info.value.command_exit_code == 9
    markers_absent(hosts, marker)


def test_binary_stdin_and_one_tar_stream_into_the_container(hosts: Any, tmp_path: Path) -> None:
    import io
    import tarfile

    payload = os.urandom(3 * 1024 * 1024)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("pkg/blob bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    dest = f"/tmp/fleet-put-{uuid.uuid4().hex[:8]}/rel 1"
    with open_target(spec(hosts)) as target:
        digest = target.run(["sha256sum"], stdin=payload).stdout.split()[0]
        assert digest == hashlib.sha256(payload).hexdigest()
        buf.seek(0)
        target.put_tar(buf, dest)
        stored = target.run(["sha256sum", f"{dest}/pkg/blob bin"]).stdout.split()[0]
        assert stored == hashlib.sha256(payload).hexdigest()
        target.run(["rm", "-rf", os.path.dirname(dest)])


def test_one_connection_is_reused_for_every_command(hosts: Any) -> None:
    with open_target(spec(hosts)) as target:
        assert isinstance(target, SshTarget)
        target.run(["true"])
        transport = target.connection().client.get_transport()
        for _ in range(3):
            target.run(["true"])
            target.run(["true"], where="host")
        assert target.connection().client.get_transport() is transport


def test_a_cut_link_mid_stream_is_a_target_error(hosts: Any, relay: tuple[Relay, str]) -> None:
    link, known = relay
    target = open_target(spec(hosts, port=link.port, known_hosts=known, container=False))
    target.run(["true"])
    link.cut_after = link.forwarded + 256 * 1024

    def endless() -> Iterator[bytes]:
        while True:
            yield b"\0" * 65536

    err = raises_without_hanging(lambda: target.run(["sh", "-c", "cat > /dev/null"], stdin=endless()))
    assert isinstance(err, TargetError) and " lost " in str(err), err
    target.close()


def test_a_stalled_link_mid_stream_is_a_target_error(hosts: Any, relay: tuple[Relay, str]) -> None:
    link, known = relay
    target = open_target(spec(hosts, port=link.port, known_hosts=known, container=False), io_timeout_s=2)
    target.run(["true"])
    link.stall_after = link.forwarded + 256 * 1024

    def endless() -> Iterator[bytes]:
        while True:
            yield b"\0" * 65536

    # (not put_tar: tar reads zero blocks as the end of an archive and exits early)
    err = raises_without_hanging(lambda: target.run(["sh", "-c", "cat > /dev/null"], stdin=endless()))
    assert isinstance(err, TargetError) and "lost while sending data" in str(err), err
    target.close()
