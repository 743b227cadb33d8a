# shellcheck shell=sh
# The build lock of one env on a target (fleet.envs.build_lock), sent as
#   sh -c <this> fleet-env-lock LOCK_FILE TOKEN
# waits for an exclusive flock on LOCK_FILE, writes TOKEN into it (how the controller learns that
# it holds the lock), then holds it until its stdin ends. The controller keeps that stdin open for
# the whole build, so a controller that dies or loses its connection releases the lock with it:
# no stale lock to clean up. Without flock (util-linux) builds are not serialized, as before.
mkdir -p -- "$(dirname -- "$1")" || exit 1
exec 9>>"$1" || exit 1
if command -v flock >/dev/null 2>&1; then
    flock 9 || exit 1
fi
printf '%s\n' "$2" > "$1" || exit 1
exec cat > /dev/null
