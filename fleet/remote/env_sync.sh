# shellcheck shell=sh
# A new env's venv, then its packages (fleet.envs), sent as
#   sh -c <this> fleet-env-sync UV PYTHON VENV_DIR SYNC_ARGV...
# creates a relocatable venv at VENV_DIR with PYTHON, then runs SYNC_ARGV (`uv sync --locked ...`).
"$1" venv -q --relocatable --no-project --python "$2" "$3" && shift 3 && exec "$@"
