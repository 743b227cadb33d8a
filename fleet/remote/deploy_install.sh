# shellcheck shell=sh
# fleet deploy, step 2 of 2 (sent as `sh -c <this> fleet-put-tar WORKDIR TMPNAME ID [PRUNE...]`,
# the release as one tar stream on stdin). Extracts into releases/TMPNAME, checks the upload is
# complete (MANIFEST.json is the tar's last member), moves it to releases/ID, switches `current`
# with one rename(2) of a new symlink, then prunes the releases the caller named.
# Any failure before the final `mv -T` (a cut stream, a full disk) leaves `current` untouched;
# the half upload stays as releases/.tmp-* until the next deploy removes it.
# One deploy at a time per workdir: flock(1) on .deploy.lock, held until this script ends (the
# kernel drops it when a killed deploy dies: no stale lock). A second deploy exits 75 at once,
# touching nothing. Without flock (no util-linux) deploys are not serialized.
set -eu
workdir=$1
tmp=$2
id=$3
shift 3
cd -- "$workdir"
if command -v flock >/dev/null 2>&1; then
    exec 9>>.deploy.lock
    if ! flock -n 9; then
        cat >/dev/null  # take the upload so the sender ends cleanly; nothing is written
        echo "another deploy into $workdir is running (it holds $workdir/.deploy.lock)" >&2
        exit 75
    fi
fi
for left in releases/.tmp-* .current.tmp-*; do  # what killed deploys left behind
    if [ -e "$left" ] || [ -L "$left" ]; then
        rm -rf -- "$left"
    fi
done
mkdir -- "releases/$tmp"
tar -x -f - -C "releases/$tmp"
test -f "releases/$tmp/MANIFEST.json" || { echo "upload incomplete: no MANIFEST.json" >&2; exit 65; }
if [ -e "releases/$id" ]; then
    echo "release $id already exists" >&2
    exit 73
fi
mv -T -- "releases/$tmp" "releases/$id"
ln -s -- "releases/$id" ".current.tmp-$id"
mv -T -- ".current.tmp-$id" current
# Prune only after the switch succeeded; the caller never names the current or a live run's release.
for old in "$@"; do
    if [ "$(readlink current)" != "releases/$old" ]; then
        rm -rf -- "releases/$old"
    fi
done
