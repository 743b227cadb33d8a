# shellcheck shell=sh
# Whether this controller holds an env's build lock yet (fleet.envs.build_lock), sent as
#   sh -c <this> fleet-env-lock-wait LOCK_FILE TOKEN SECONDS
# waits on the target, up to SECONDS, for LOCK_FILE to hold TOKEN (env_lock.sh writes it once its
# flock is taken), then prints `held`, or `waiting` when another deploy still holds it. One call
# per SECONDS instead of a round trip per poll.
polls=$(($3 * 5))
i=0
while :; do
    if [ "$(cat -- "$1" 2>/dev/null)" = "$2" ]; then
        echo held
        exit 0
    fi
    [ "$i" -ge "$polls" ] && break
    sleep 0.2
    i=$((i + 1))
done
echo waiting
