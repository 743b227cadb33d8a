# shellcheck shell=sh
# What a target has for building envs (fleet.envs), sent as
#   sh -c <this> fleet-env-provision TMUX UV_CANDIDATE...
# Prints tab-separated lines: `machine <uname -m>`, `tmux <tmux -V>` when tmux runs, and
# `uv <path> <uv --version>` for each candidate uv that runs.
printf 'machine\t%s\n' "$(uname -m)"
if t=$("$1" -V 2>/dev/null); then printf 'tmux\t%s\n' "$t"; fi
shift
for c in "$@"; do
    if v=$("$c" --version 2>/dev/null); then printf 'uv\t%s\t%s\n' "$c" "$v"; fi
done
