"""fleet.known_hosts against OpenSSH itself: for each host, the lines `ssh-keygen -F HOST` finds
(plain keys, @cert-authority, @revoked) are the lines fleet finds, in a file with comments,
patterns, negations, ports, markers, odd whitespace and bad lines, and in its hashed form
(`ssh-keygen -H`). The keys are real keys made by ssh-keygen."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import paramiko
import pytest

from fleet import known_hosts as kh

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen")

HOSTS = (
    "pve.example.com",
    "PVE.Example.COM",
    "[pve.example.com]:2222",
    "bad.example.com",
    "x.example.com",
    "host1.lab",
    "hostx.lab",
    "host12.lab",
    "10.0.0.5",
    "[10.0.0.5]:22",
    "elsewhere.org",
    "short-line",
)
KIND = {"": "", "CA": "cert-authority", "REVOKED": "revoked"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("keys")
    found = {}
    for name, args in {
        "ed": ["-t", "ed25519"],
        "ec": ["-t", "ecdsa"],
        "rsa": ["-t", "rsa", "-b", "1024"],
    }.items():
        subprocess.run(
            ["ssh-keygen", "-q", *args, "-N", "", "-C", name, "-f", str(folder / name)], check=True
        )
        found[name] = " ".join((folder / f"{name}.pub").read_text().split()[:2])
    return found


def sample(keys: dict[str, str], *, invalid: bool = True) -> str:
    """A known_hosts text; ``invalid`` adds the lines ssh skips (ssh-keygen -H refuses a file with them)."""
    ed, ec, rsa = keys["ed"], keys["ec"], keys["rsa"]
    bad = f"@bogus-marker host1.lab {rsa}\nshort-line ssh-ed25519\n" if invalid else ""
    return (
        "# a comment\n"
        "\n"
        f"pve.example.com,10.0.0.5 {ed}\n"
        f"[pve.example.com]:2222 {ec}\n"
        f"*.example.com,!bad.example.com {rsa}\n"
        f"@cert-authority *.example.com {ed}\n"
        f"@revoked pve.example.com {ec}\n"
        f"host?.lab \t {ed}  trailing comment\n"
        f"{bad}"
        f"   indented.example.org {rsa}\n"
    )


def openssh_finds(path: Path, host: str) -> set[tuple[str, str]]:
    """(kind, "type base64") of every line `ssh-keygen -F host` reports."""
    out = subprocess.run(["ssh-keygen", "-F", host, "-f", str(path)], capture_output=True, text=True).stdout
    found = set()
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# Host ") and " found: line " in line:
            kind = line.rsplit(" found: line ", 1)[1].split()[1:] or [""]
            fields = lines[i + 1].split()
            if fields[0].startswith("@"):
                fields = fields[1:]
            found.add((KIND[kind[0]], f"{fields[1]} {fields[2]}"))
    return found


def fleet_finds(text: str, host: str) -> set[tuple[str, str]]:
    name = host.lower()
    found = set()
    for line in kh.parse(text):
        if line.key is not None and line.hosts and kh.host_matches(line.hosts, name):
            found.add((line.marker, f"{line.key.get_name()} {line.key.get_base64()}"))
    return found


@pytest.mark.parametrize("hashed", [False, True], ids=["plain", "hashed"])
def test_fleet_finds_what_openssh_finds(keys: dict[str, str], tmp_path: Path, hashed: bool) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(sample(keys, invalid=not hashed))
    if hashed:
        subprocess.run(["ssh-keygen", "-H", "-f", str(path)], capture_output=True, check=True)
        assert path.read_text().count("|1|") >= 4  # the plain names; patterns stay as they are
    text = path.read_text()
    for host in HOSTS:
        # ssh looks a host up by its lower-case name (ssh.c lowercases it); ssh-keygen -F does not
        assert fleet_finds(text, host) == openssh_finds(path, host.lower()), host
    assert openssh_finds(path, "pve.example.com")  # the oracle does find things


def test_lookup_trusts_plain_keys_only_and_never_a_revoked_one(keys: dict[str, str]) -> None:
    text = sample(keys)
    ed, ec = (paramiko.PKey.from_type_string(*keys[k].split()[:1], _blob(keys[k])) for k in ("ed", "ec"))
    pve = kh.lookup(kh.parse(text), "pve.example.com")
    assert [n for n, _ in pve.keys] == [3, 5] and pve.cert_authorities == (6,)
    assert pve.revoked_line(ec) == 7 and pve.revoked_line(ed) is None
    assert pve.trusts(ed) and not pve.trusts(ec)
    # the [host]:2222 key is revoked by line 7 only for pve.example.com (port 22), not for port 2222
    port = kh.lookup(kh.parse(text), kh.host_string("pve.example.com", 2222))
    assert port.trusts(ec) and port.revoked == ()
    assert kh.lookup(kh.parse(text), "bad.example.com").keys == ()  # negated: the rsa line does not apply
    short = kh.lookup(kh.parse(text), "short-line")
    assert short.keys == () and short.unsupported == ((10, "fewer than 3 fields (host keytype key)"),)


def test_unknown_key_types_and_bad_base64_are_named_not_fatal() -> None:
    text = "h1 ssh-foo AAAAB3NzaC1yc2E=\nh2 ssh-ed25519 not*base64\n"
    lines = kh.parse(text)
    assert [ln.key for ln in lines] == [None, None]
    assert "ssh-foo is not supported" in lines[0].problem and "base64" in lines[1].problem
    assert kh.lookup(lines, "h1").unsupported[0][0] == 1


def test_host_string_and_new_line(keys: dict[str, str]) -> None:
    assert kh.host_string("PVE.example.com", 22) == "pve.example.com"
    assert kh.host_string("127.0.0.1", 2235) == "[127.0.0.1]:2235"
    key = paramiko.PKey.from_type_string("ssh-ed25519", _blob(keys["ed"]))
    line = kh.new_line("[127.0.0.1]:2235", key)
    assert line == f"[127.0.0.1]:2235 {keys['ed']}\n"
    assert kh.lookup(kh.parse(line), "[127.0.0.1]:2235").trusts(key)


def _blob(public: str) -> bytes:
    import base64

    return base64.b64decode(public.split()[1])
