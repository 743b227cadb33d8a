"""The README's test command on a fresh Debian 12 machine with only the README's prerequisites.

    .venv/bin/python benchmarks/fresh_tests.py [--keep]

A new LXC container from the debootstrapped rootfs that tests/hosts/setup caches (tests/freshct.py;
run the setup first), with `procps` removed from it (the rootfs has it; the README's apt line must
bring it), then exactly what the README says: its `apt-get install -y ...` line, the hostname line
for /etc/hosts, `git clone`, and `./bootstrap --dev && .venv/bin/python -m pytest`. The host's
uv cache and llama.cpp build cache are bind-mounted (torch is downloaded and llama.cpp built once
per machine, not per run; `--no-llama-cache` builds it inside). There is no test
host inside, so the hosts tier skips, as it does on any machine without `tests/hosts/setup`.

Prints each step's wall time, the tail of pytest's output and one summary line; exit code is the
test command's. The container is removed at the end (`--keep` keeps it for a look inside).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import freshct  # tests/freshct.py: the fresh-container helper of the e2e test

from training.engines.llamacpp import default_cache_root as default_llama_cache

TEST_COMMAND = "./bootstrap --dev && .venv/bin/python -m pytest"
HOSTNAME_LINE = 'echo "127.0.1.1 $(hostname)" >> /etc/hosts'  # the README's, for a bare chroot


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the container afterwards")
    parser.add_argument("--name", default="fresh-tests", help="container name (default: fresh-tests)")
    parser.add_argument(
        "--no-llama-cache", dest="llama_cache", action="store_false", help="build llama.cpp inside"
    )
    parser.add_argument("--timeout", type=float, default=5400, help="seconds for the test command")
    args = parser.parse_args(argv)

    uv = str(freshct.REPO / ".venv" / "bin" / "uv")
    uv_dir = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    started = time.monotonic()
    # The llama.cpp build is a per-machine cache like uv's (its first build: ~35 min on 2 cores):
    # this machine's is bind-mounted in when it exists (the same Debian 12), else built inside.
    llama = default_llama_cache()
    binds = {llama: "/root/.cache/fleet-llama.cpp"} if args.llama_cache and llama.is_dir() else {}
    ct = freshct.create(args.name, uv_cache=Path(uv_dir), binds=binds)
    print(f"fresh_tests: bind-mounted: uv cache {uv_dir}" + "".join(f", {h}" for h in binds), flush=True)
    try:
        steps = [
            ("remove procps (the rootfs cache has it)", "apt-get purge -y -qq procps >/dev/null", 600),
            (
                "README's apt line",
                "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                + " ".join(freshct.readme_prerequisites()),
                1800,
            ),
            ("README's hostname line", HOSTNAME_LINE, 60),
            ("git clone", "cd /root && git clone -q fleet.git fleet", 300),
        ]
        for what, script, timeout in steps:
            done, took = freshct.timed(ct, script, env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=timeout)
            print(f"fresh_tests: {what}: {took:.1f} s, exit {done.returncode}", flush=True)
            if done.returncode != 0:
                print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
                return done.returncode
        done, took = freshct.timed(ct, f"cd /root/fleet && {TEST_COMMAND}", timeout=args.timeout)
        tail = (done.stdout + done.stderr).strip().splitlines()[-40:]
        print("\n".join(tail))
        counts = [line for line in tail if " in " in line and ("passed" in line or "failed" in line)]
        summary = counts[-1] if counts else ""
        print(
            f"fresh_tests: `{TEST_COMMAND}` in a fresh Debian 12 container: {took:.1f} s "
            f"({took / 60:.1f} min), exit {done.returncode}; {summary.strip('= ')}; "
            f"whole script {time.monotonic() - started:.1f} s",
            flush=True,
        )
        return done.returncode
    finally:
        if not args.keep:
            ct.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
