# shellcheck shell=sh
# fleet run dirs (sent as `sh -c <this> fleet-runs WORKDIR KEEP`): with KEEP > 0 first removes the
# run dirs older than the newest KEEP, never runs/latest's and never a live one (run_alive);
# then lists what is left. Per run, one block:
#   @@run ID
#   exit_code, size in KiB (du -sk), newest checkpoint file name, launches (segments.jsonl lines)
#   the last step event line and the last phase event line of events.jsonl (its last 64 KiB)
# and a line `@@removed ID` for each run dir removed.
workdir=$1
keep=$2
runs="$workdir/runs"
[ -d "$runs" ] || exit 0
latest=$(readlink -- "$runs/latest" 2>/dev/null) || latest=""
# A run is alive while RUN_DIR/lock is held: run.sh takes it first and every process of the run
# inherits it, so it outlives tmux and run.sh itself. Without flock, or for a run dir from before
# the lock, a process of the recorded group that is not a zombie (tmux may leave a dead pane's
# process unreaped). Never `kill -0 -- -PGID`: dash rejects it.
run_alive() {
    if [ -e "$1/lock" ] && command -v flock >/dev/null 2>&1; then
        flock -n -s -E 75 "$1/lock" true 2>/dev/null
        [ $? -eq 75 ]
        return
    fi
    pgid=$(cat -- "$1/pgid" 2>/dev/null) || return 1
    case "$pgid" in '' | *[!0-9]*) return 1 ;; esac
    for st in /proc/[0-9]*/stat; do
        { read -r line < "$st"; } 2>/dev/null || continue
        rest=${line##*) }
        # shellcheck disable=SC2086
        set -- $rest
        if [ "${3:-}" = "$pgid" ] && [ "$1" != Z ]; then
            return 0
        fi
    done
    return 1
}
if [ "$keep" -gt 0 ]; then
    # Run ids start with their UTC start time: the name order is the age order.
    # shellcheck disable=SC2012
    ls -1 -- "$runs" | LC_ALL=C sort -r | while read -r id; do
        dir="$runs/$id"
        case "$id" in latest | .*) continue ;; esac
        if [ ! -d "$dir" ] || [ -L "$dir" ]; then continue; fi
        if [ "$keep" -gt 0 ]; then
            keep=$((keep - 1))
            continue
        fi
        if [ "$id" = "$latest" ] || run_alive "$dir"; then
            continue
        fi
        rm -rf -- "$dir" && printf '@@removed %s\n' "$id"
    done
fi
for dir in "$runs"/*; do
    id=${dir##*/}
    if [ ! -d "$dir" ] || [ -L "$dir" ]; then continue; fi
    printf '@@run %s\n' "$id"
    printf 'exit_code %s\n' "$(cat -- "$dir/exit_code" 2>/dev/null)"
    printf 'alive %s\n' "$(run_alive "$dir" && echo 1 || echo 0)"
    printf 'size_kib %s\n' "$(du -sk -- "$dir" 2>/dev/null | cut -f1)"
    newest=""
    for ck in "$dir"/checkpoints/step-*.pt; do
        [ -e "$ck" ] && newest=${ck##*/}  # the glob's order is the step order (zero-padded)
    done
    printf 'checkpoint %s\n' "$newest"
    printf 'launches %s\n' "$(cat -- "$dir/segments.jsonl" 2>/dev/null | wc -l)"
    tail -c 65536 -- "$dir/events.jsonl" 2>/dev/null | grep -E '"event": ?"step"' | tail -n 1 | sed 's/^/step /'
    tail -c 65536 -- "$dir/events.jsonl" 2>/dev/null | grep -E '"event": ?"phase"' | tail -n 1 | sed 's/^/phase /'
done
printf '@@latest %s\n' "$latest"
