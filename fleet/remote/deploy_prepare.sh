# shellcheck shell=sh
# fleet deploy, step 1 of 2 (sent as `sh -c <this> fleet-deploy-prepare WORKDIR TMUX SESSION RUN_JSON`).
# Creates the workdir skeleton and reports the state deploy needs, in the prelude's sections: the
# existing releases, where `current` points, and the live run (never pruned): its tmux pane and
# the latest run's RUN_JSON (the record's file name). It changes nothing else: what killed deploys
# left behind is removed by step 2, under the deploy lock (another deploy may be uploading now).
set -eu
workdir=$1
tmux=$2
session=$3
run_json=$4
# fleet: include prelude.sh
mkdir -p -- "$workdir/releases" "$workdir/runs"
section current readlink -- "$workdir/current"
releases() {
    for rel in "$workdir"/releases/*; do
        if [ -d "$rel" ]; then
            printf '%s\n' "${rel##*/}"
        fi
    done
}
section releases releases
section pane "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid}'
section run_json cat -- "$workdir/runs/latest/$run_json"
emit end 0 ""
