# shellcheck shell=sh
# What the run-dir scripts share, put in place of their `# fleet: include rundir.sh` line by
# fleet/remote/__init__.py's script(), after the script's `# fleet: include contract` (the run
# dir's names: $LOCK_FILE, $PGID_FILE). POSIX sh (dash on Debian/Proxmox).
# run_alive RUN_DIR: a run is alive while its lock file is held: run.sh takes it first and every
# process of the run inherits it, so it outlives tmux and run.sh itself. Without flock, or for a
# run dir from before the lock, a process of the recorded group that is not a zombie (tmux may
# leave a dead pane's process unreaped). Never `kill -0 -- -PGID`: dash rejects it.
run_alive() {
    if [ -e "$1/$LOCK_FILE" ] && command -v flock >/dev/null 2>&1; then
        flock -n -s -E 75 "$1/$LOCK_FILE" true 2>/dev/null
        [ $? -eq 75 ]
        return
    fi
    pgid=$(cat -- "$1/$PGID_FILE" 2>/dev/null) || return 1
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
# latest_run WORKDIR: the latest run's id: runs/latest, or when that dangles (its dir removed by
# hand) or is missing while run dirs exist, the newest run dir (run ids start with their UTC
# start time).
latest_run() {
    id=$(readlink -- "$1/runs/latest" 2>/dev/null) || id=""
    id=${id##*/}
    if [ -n "$id" ] && [ -d "$1/runs/$id" ] && [ ! -L "$1/runs/$id" ]; then
        printf '%s' "$id"
        return
    fi
    id=""
    for d in "$1"/runs/*; do
        if [ -d "$d" ] && [ ! -L "$d" ]; then id=${d##*/}; fi
    done
    printf '%s' "$id"
}
