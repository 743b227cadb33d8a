# shellcheck shell=sh
# `fab doctor`: the Proxmox host's side of a container target, in one round trip. Sent as
# `sh -c <this> fleet-doctor-host KIND CT PCT NVSMI TIMEOUT GPU`:
#   KIND   pct | lxc          CT        the container id (pct) or name (lxc)
#   PCT    pct command        NVSMI     nvidia-smi command      TIMEOUT  seconds per nvidia-smi call
#   GPU    1: the GPU facts too (nvidia-smi -q -x, topo -m, topo -p2p r); 0: the container's config only
# Reads only; prints sections `@@fleet <name> <exit code>` followed by their text. POSIX sh.
kind=$1
ct=$2
pct=$3
# shellcheck disable=SC2034  # smi and timeout_s are read by the prelude
smi=$4 timeout_s=$5
gpu=$6

# fleet: include prelude.sh
# fleet: include doctor.sh
lxc_config() {  # a plain LXC container's config file (the lxc.* lines pct would print)
    lxcpath=$(lxc-config lxc.lxcpath 2>/dev/null || echo /var/lib/lxc)
    cat "$lxcpath/$1/config"
}

if [ "$kind" = pct ]; then
    section ct_config "$pct" config "$ct"
else
    out=$(lxc_config "$ct" 2>&1)
    emit ct_config "$?" "$out"
fi
section cgroupfs stat -f -c %T /sys/fs/cgroup
section module cat /proc/driver/nvidia/version
section proc_devices grep -i nvidia /proc/devices
out=$(nodes 2>&1)
emit nodes "$?" "$out"
if [ "$gpu" = 1 ]; then
    smi_section smi_xml -q -x
    smi_section topo topo -m
    smi_section p2p topo -p2p r
fi
exit 0
