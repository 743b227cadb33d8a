# shellcheck shell=sh
# The interpreter an env is built with (fleet.envs), sent as
#   sh -c <this> fleet-env-find-python UV REQUIRES_PYTHON ENV_PROBE
# Runs ENV_PROBE's `interp` report with the Python uv finds for REQUIRES_PYTHON; exit 3 when uv
# finds none (the caller then lets uv install one and asks again).
p=$("$1" python find --system --no-project "$2") || exit 3
exec "$p" -I "$3" interp
