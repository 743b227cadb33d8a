# shellcheck shell=sh
# fleet deploy, step 1 of 2 (sent as `sh -c <this> fleet-deploy-prepare WORKDIR TMUX SESSION`).
# Creates the workdir skeleton and reports the state deploy needs: the existing releases, where
# `current` points, and the live run (never pruned). It changes nothing else: what killed deploys
# left behind is removed by step 2, under the deploy lock (another deploy may be uploading now).
set -eu
workdir=$1
tmux=$2
session=$3
mkdir -p -- "$workdir/releases" "$workdir/runs"
printf '@@current\n'
readlink -- "$workdir/current" || true
printf '@@releases\n'
for rel in "$workdir"/releases/*; do
    if [ -d "$rel" ]; then
        printf '%s\n' "${rel##*/}"
    fi
done
printf '@@pane\n'
"$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid}' 2>/dev/null || true
printf '\n@@run_json\n'
cat -- "$workdir/runs/latest/run.json" 2>/dev/null || true
printf '\n@@end\n'
