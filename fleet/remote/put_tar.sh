# shellcheck shell=sh
# Extract the tar stream on stdin into a directory, created if missing (fleet.target.put_tar),
# sent as   sh -c <this> fleet-put-tar DEST_DIR
mkdir -p -- "$1" && exec tar -x -f - -C "$1"
