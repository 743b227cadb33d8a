#!/bin/sh
# Wall time and CPU time of a command and of everything it starts: the test suite's cost on a
# machine shared with other work, where wall time alone says little.
#
#   sh benchmarks/suite_time.sh .venv/bin/python -m pytest
#
# CPU time is read from a cpuacct cgroup (cgroup v1, as root) made for the command, plus what
# this checkout's test containers used meanwhile (their processes live in LXC's own cgroups:
# lxc.payload.<prefix>*, prefix from tests/hosts/.state/hosts.env). Processes started through
# the test sshd are counted only where they run in a container. A container's cgroup that is made
# anew during the command (a container restarted: LXC names its cgroup name-1) counts from zero.
# Also the whole machine's busy CPU time over the same interval (/proc/stat): on a quiet machine,
# the suite's full cost whatever ran it. Prints one line at the end:
#   suite_time: wall 812.3 s, cpu 1520.4 s (command 1391.0 s, containers 129.4 s), machine 1544.0 s, rc 0
set -eu
cd "$(dirname "$0")/.."
acct=/sys/fs/cgroup/cpuacct
[ -w "$acct" ] || { echo "suite_time: needs root and a cgroup v1 cpuacct hierarchy at $acct" >&2; exit 2; }

prefix=""
if [ -f tests/hosts/.state/hosts.env ]; then
    name=$(sed -n 's/^FLEET_TEST_CT_NAME=//p' tests/hosts/.state/hosts.env)
    id=$(sed -n 's/^FLEET_TEST_CT_ID=//p' tests/hosts/.state/hosts.env)
    prefix=${name%"ct$id"}
fi

containers_usage() {  # one line per container cgroup: its path and its usage in ns
    if [ -n "$prefix" ]; then
        for usage in "$acct"/lxc.payload."$prefix"*/cpuacct.usage; do
            [ -f "$usage" ] && echo "$usage $(cat "$usage")"
        done
    fi
    return 0
}

machine_ticks() {  # busy ticks of all CPUs: user nice system irq softirq steal
    awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat
}

group="$acct/suite-time-$$"
mkdir "$group"
trap 'rmdir "$group" 2>/dev/null || true' EXIT
ct_before=$(containers_usage)
ticks_before=$(machine_ticks)
start=$(date +%s%N)
rc=0
sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$group" "$@" || rc=$?
end=$(date +%s%N)
ticks_after=$(machine_ticks)
ct_after=$(containers_usage)
own=$(cat "$group/cpuacct.usage")
# Per cgroup, what it used meanwhile; a container made and removed by the command (the
# fresh-machine test's) took its usage with it: the machine figure has it.
ct=$(printf '%s\n--\n%s\n' "$ct_before" "$ct_after" | awk '
    $0 == "--" { after = 1; next }
    NF == 2 && !after { before[$1] = $2 }
    NF == 2 && after { d = $2 - (($1 in before) ? before[$1] : 0); total += (d > 0 ? d : 0) }
    END { printf "%d", total }')
hz=$(getconf CLK_TCK)
awk -v w=$((end - start)) -v o="$own" -v c="$ct" -v t=$((ticks_after - ticks_before)) -v hz="$hz" -v rc="$rc" 'BEGIN {
    printf "suite_time: wall %.1f s, cpu %.1f s (command %.1f s, containers %.1f s), machine %.1f s, rc %d\n",
        w / 1e9, (o + c) / 1e9, o / 1e9, c / 1e9, t / hz, rc }'
exit "$rc"
