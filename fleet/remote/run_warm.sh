# shellcheck shell=sh
# `fab warm` on a target (fleet.runs), sent as   sh -c <this> fleet-run-warm ARGV...
# stdin: the run's environment as shell-quoted `export K='v'` lines (fleet.runs.env_file_text),
# so its values never appear in argv or `ps`; then ARGV (`python -m training warm ...`) runs.
eval "$(cat)" && exec "$@"
