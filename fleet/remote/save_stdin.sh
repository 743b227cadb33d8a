# shellcheck shell=sh
# Save stdin as the file $1 (its folder made if missing): a log kept on the target.
mkdir -p -- "$(dirname -- "$1")" && cat >"$1"
