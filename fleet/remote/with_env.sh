# shellcheck shell=sh
# Run a command with the run's environment (fleet.runs.run_with_env), sent as
#   sh -c <this> fleet-with-env ARGV...
# stdin: the environment as shell-quoted `export K='v'` lines (fleet.runs.env_file_text), so its
# values (secrets) are never in argv, `ps`, or a file; then ARGV replaces this shell.
eval "$(cat)" && exec "$@"
