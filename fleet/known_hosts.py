"""OpenSSH ``known_hosts`` files, read the way ``ssh`` reads them (pure: text in, data out).

paramiko's own loader handles plain ``host keytype key`` lines only; a file written by OpenSSH
may also hold what sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT" allows, and ``ssh`` itself accepts:

- ``#`` comments and blank lines;
- a marker before the host field: ``@cert-authority`` (the key is a CA that signs host
  certificates) or ``@revoked`` (for the hosts it matches, the key must never be accepted, even
  where another line lists it);
- host patterns, comma-separated: ``*`` and ``?`` wildcards, ``!pattern`` negation (a negated
  match makes the whole line not apply), ``[host]:port`` for a port other than 22;
- hashed hosts (``HashKnownHosts yes``): ``|1|<base64 salt>|<base64 HMAC-SHA1(salt, host)>``;
- any whitespace between fields, and a trailing comment.

Matching follows OpenSSH's hostfile.c / match.c: the host string is ``host`` for port 22 and
``[host]:port`` otherwise, compared case-insensitively with each pattern. What fleet cannot use
is said, not guessed at: a ``@cert-authority`` line (paramiko verifies plain host keys, not host
certificates) and a key type paramiko cannot load are reported with their line number, and never
make a host trusted. Lines that do not concern the host are ignored, as ``ssh`` ignores them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass, field

import paramiko

MARKERS = {"@cert-authority": "cert-authority", "@revoked": "revoked"}
HASH_MAGIC = "|1|"


@dataclass(frozen=True)
class Line:
    """One non-comment line of a known_hosts file."""

    lineno: int
    marker: str  # "", "cert-authority" or "revoked"
    hosts: str  # the host field as written (patterns, or one hashed entry)
    key_type: str
    key: paramiko.PKey | None  # None when the key cannot be loaded (``problem`` says why)
    problem: str = ""


@dataclass(frozen=True)
class Lookup:
    """What a known_hosts file says about one host string."""

    host: str
    keys: tuple[tuple[int, paramiko.PKey], ...] = ()  # trusted keys (line number, key), revoked ones left out
    revoked: tuple[tuple[int, paramiko.PKey], ...] = ()
    cert_authorities: tuple[int, ...] = ()  # lines naming this host as signed by a CA
    unsupported: tuple[tuple[int, str], ...] = field(default=())  # (line number, why) for this host

    def revoked_line(self, key: paramiko.PKey) -> int | None:
        """The line that revokes ``key``, or None."""
        return next((n for n, k in self.revoked if _same_key(k, key)), None)

    def trusts(self, key: paramiko.PKey) -> bool:
        return any(_same_key(k, key) for _, k in self.keys)


def _same_key(a: paramiko.PKey, b: paramiko.PKey) -> bool:
    return a.get_name() == b.get_name() and a.asbytes() == b.asbytes()


def host_string(hostname: str, port: int) -> str:
    """What ssh looks up: ``host`` for port 22, ``[host]:port`` otherwise (lower case)."""
    name = hostname.lower()
    return name if port == 22 else f"[{name}]:{port}"


def parse(text: str) -> list[Line]:
    """Every non-comment, non-blank line; lines ``ssh`` would skip carry a ``problem``."""
    lines: list[Line] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        marker = ""
        if fields[0].startswith("@"):
            if fields[0] not in MARKERS:
                lines.append(Line(lineno, "", "", "", None, f"unknown marker {fields[0]}"))
                continue
            marker = MARKERS[fields[0]]
            fields = fields[1:]
        if len(fields) < 3:
            hosts = fields[0] if fields else ""
            lines.append(Line(lineno, marker, hosts, "", None, "fewer than 3 fields (host keytype key)"))
            continue
        hosts, key_type, blob = fields[0], fields[1], fields[2]
        key, problem = _load_key(key_type, blob)
        lines.append(Line(lineno, marker, hosts, key_type, key, problem))
    return lines


def _load_key(key_type: str, blob: str) -> tuple[paramiko.PKey | None, str]:
    try:
        data = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        return None, "the key is not valid base64"
    try:
        key = paramiko.PKey.from_type_string(key_type, data)
    except paramiko.pkey.UnknownKeyType:
        return None, f"key type {key_type} is not supported by fleet's SSH client (paramiko)"
    except (paramiko.SSHException, ValueError, TypeError, IndexError, AssertionError) as err:
        return None, f"the {key_type} key cannot be read ({err or type(err).__name__})"
    return key, ""


def _pattern_re(pattern: str) -> re.Pattern[str]:
    """OpenSSH's match_pattern: ``*`` any run, ``?`` one character, all else literal."""
    parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern]
    return re.compile("".join(parts), re.DOTALL)


def _hashed_match(entry: str, host: str) -> bool:
    """``|1|salt|hash``: HMAC-SHA1 of the host string keyed by the salt (hostfile.c host_hash)."""
    parts = entry[len(HASH_MAGIC) :].split("|")
    if len(parts) != 2:
        return False
    try:
        salt, want = base64.b64decode(parts[0], validate=True), base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        return False
    got = hmac.new(salt, host.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(got, want)


def host_matches(hosts: str, host: str) -> bool:
    """Does the host field ``hosts`` (patterns or a hashed entry) apply to ``host``?"""
    if hosts.startswith(HASH_MAGIC):
        return _hashed_match(hosts, host)
    matched = False
    for pattern in hosts.split(","):
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if not pattern:
            continue
        if _pattern_re(pattern.lower()).fullmatch(host.lower()):
            if negated:
                return False  # a negated match rejects the line whatever else matches
            matched = True
    return matched


def lookup(lines: list[Line], host: str) -> Lookup:
    """The keys, revocations, CA lines and unusable lines of ``lines`` that apply to ``host``."""
    keys: list[tuple[int, paramiko.PKey]] = []
    revoked: list[tuple[int, paramiko.PKey]] = []
    cas: list[int] = []
    unsupported: list[tuple[int, str]] = []
    for line in lines:
        if not line.hosts or not host_matches(line.hosts, host):
            continue
        if line.marker == "revoked":  # usually `@revoked * <key>`: never accept that key
            if line.key is not None:
                revoked.append((line.lineno, line.key))
            else:
                unsupported.append((line.lineno, line.problem))
        elif line.marker == "cert-authority":
            cas.append(line.lineno)
        elif line.key is None:
            unsupported.append((line.lineno, line.problem))
        else:
            keys.append((line.lineno, line.key))
    trusted = [(n, k) for n, k in keys if not any(_same_key(k, r) for _, r in revoked)]
    return Lookup(host, tuple(trusted), tuple(revoked), tuple(cas), tuple(unsupported))


def new_line(host: str, key: paramiko.PKey) -> str:
    """The line ``ssh`` appends for a newly accepted key (StrictHostKeyChecking=accept-new)."""
    return f"{host} {key.get_name()} {key.get_base64()}\n"
