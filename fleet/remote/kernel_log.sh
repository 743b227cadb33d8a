# shellcheck shell=sh
# The kernel's OOM-killer lines, for `fab status` of a run that ended by SIGKILL (fleet.status.fetch),
# sent as   sh -c <this> fleet-kernel-log   (on the host: the kernel log is the host's).
# Prints the clock and the uptime (to place dmesg's seconds-since-boot), then the matching lines,
# or `unreadable` when dmesg is refused (kernel.dmesg_restrict, an unprivileged container).
printf '%s %s\n' "$(date +%s)" "$(cut -d' ' -f1 /proc/uptime 2>/dev/null)"
log=$(dmesg 2>/dev/null) || { echo unreadable; exit 0; }
printf '%s\n' "$log" | grep -i -e 'killed process' -e 'oom-kill' -e 'invoked oom-killer' | tail -n 20
exit 0
