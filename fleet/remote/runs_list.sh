# shellcheck shell=sh
# fleet run dirs (sent as `sh -c <this> fleet-runs WORKDIR KEEP`): with KEEP > 0 first removes the
# run dirs older than the newest KEEP, never runs/latest's and never a live one (run_alive);
# then lists what is left, in the prelude's sections: `removed` (the ids removed, one a line), per
# run a section `run ID` of `key value` lines (exit_code, alive, size in KiB (du -sk), newest
# checkpoint file name, launches (segments.jsonl lines), the last step event line and the last
# phase event line of events.jsonl (its last 64 KiB)), and `latest` (runs/latest's target).
workdir=$1
keep=$2
runs="$workdir/runs"
[ -d "$runs" ] || exit 0
latest=$(readlink -- "$runs/latest" 2>/dev/null) || latest=""
# fleet: include contract
# fleet: include prelude.sh
# fleet: include rundir.sh
nl='
'
removed=""
if [ "$keep" -gt 0 ]; then
    # Run ids start with their UTC start time: the name order is the age order.
    # shellcheck disable=SC2012
    removed=$(ls -1 -- "$runs" | LC_ALL=C sort -r | while read -r id; do
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
        rm -rf -- "$dir" && printf '%s\n' "$id"
    done)
fi
emit removed 0 "$removed"
summary() {  # summary DIR: the `key value` lines of one run
    printf 'exit_code %s\n' "$(cat -- "$1/$EXIT_CODE_FILE" 2>/dev/null)"
    printf 'alive %s\n' "$(run_alive "$1" && echo 1 || echo 0)"
    printf 'size_kib %s\n' "$(du -sk -- "$1" 2>/dev/null | cut -f1)"
    newest=""
    # $CHECKPOINT_GLOB unquoted: it is the glob
    for ck in "$1/$CHECKPOINT_DIR"/$CHECKPOINT_GLOB; do
        [ -e "$ck" ] && newest=${ck##*/}  # the glob's order is the step order (zero-padded)
    done
    printf 'checkpoint %s\n' "$newest"
    printf 'launches %s\n' "$(cat -- "$1/$SEGMENTS_FILE" 2>/dev/null | wc -l)"
    tail -c 65536 -- "$1/$EVENTS_FILE" 2>/dev/null | grep -E '"event": ?"step"' | tail -n 1 | sed 's/^/step /'
    tail -c 65536 -- "$1/$EVENTS_FILE" 2>/dev/null | grep -E '"event": ?"phase"' | tail -n 1 | sed 's/^/phase /'
}
for dir in "$runs"/*; do
    id=${dir##*/}
    if [ ! -d "$dir" ] || [ -L "$dir" ]; then continue; fi
    case "$id" in *"$nl"*) continue ;; esac  # a name no section header can carry
    emit "run $id" 0 "$(summary "$dir")"
done
emit latest 0 "$latest"
