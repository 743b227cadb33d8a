# shellcheck shell=sh
# What both doctor scripts (host and container) read the same way, put in place of their
# `# fleet: include doctor.sh` line by fleet/remote/__init__.py's script(). POSIX sh.
nodes() {  # device nodes as "path|type|major hex|minor hex"
    for node in /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools \
        /dev/nvidia-modeset /dev/nvidia-caps /dev/nvidia-caps/*; do
        [ -e "$node" ] && stat -c '%n|%F|%t|%T' "$node"
    done
    return 0
}
