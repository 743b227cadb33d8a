# shellcheck shell=sh
# fleet deploy, step 2 of 2 (sent as `sh -c <this> fleet-put-tar WORKDIR TMPNAME ID KEEP [PROTECTED...]`,
# the release as one tar stream on stdin). Under the workdir's deploy lock: checks that ID is new
# and newer than every release there, extracts into releases/TMPNAME, checks the upload is complete
# (MANIFEST.json is the tar's last member), moves it to releases/ID, switches `current` with one
# rename(2) of a new symlink, then prunes: KEEP releases stay, ID and PROTECTED (a live run's
# release) among them, the newest of the others filling the rest.
# Any failure before the final `mv -T` (a cut stream, a full disk) leaves `current` untouched;
# the half upload stays as releases/.tmp-* until the next deploy removes it.
# One deploy at a time per workdir: flock(1) on .deploy.lock, held until this script ends (the
# kernel drops it when a killed deploy dies: no stale lock). A second deploy exits 75 at once,
# touching nothing. Without flock (no util-linux) deploys are not serialized.
# Exit 76: ID exists or is not newer than the newest release (a deploy that prepared at the same
# time got in first): nothing was written; the caller proposes a newer id.
set -eu
workdir=$1
tmp=$2
id=$3
keep=$4
shift 4
cd -- "$workdir"
if command -v flock >/dev/null 2>&1; then
    exec 9>>.deploy.lock
    if ! flock -n 9; then
        cat >/dev/null  # take the upload so the sender ends cleanly; nothing is written
        echo "another deploy into $workdir is running (it holds $workdir/.deploy.lock)" >&2
        exit 75
    fi
fi
ids() {  # the release ids present (nothing else in releases/), oldest first: ids sort by time
    for rel in releases/*; do
        [ -d "$rel" ] && printf '%s\n' "${rel#releases/}"
    done | grep -E '^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{7}(-dirty)?$' | LC_ALL=C sort
}
# The id's time must be later than every release's (ids sort by time; same second = taken).
newest=$(ids | sed 's/-.*//' | tail -n 1)
if [ -n "$newest" ] && [ "$(printf '%s\n%s\n' "${id%%-*}" "$newest" | LC_ALL=C sort | tail -n 1)" = "$newest" ]; then
    cat >/dev/null
    echo "release id $id is taken or not later than the release of $newest" >&2
    exit 76
fi
for left in releases/.tmp-* .current.tmp-*; do  # what killed deploys left behind
    if [ -e "$left" ] || [ -L "$left" ]; then
        rm -rf -- "$left"
    fi
done
mkdir -- "releases/$tmp"
tar -x -f - -C "releases/$tmp"
test -f "releases/$tmp/MANIFEST.json" || { echo "upload incomplete: no MANIFEST.json" >&2; exit 65; }
mv -T -- "releases/$tmp" "releases/$id"
ln -s -- "releases/$id" ".current.tmp-$id"
mv -T -- ".current.tmp-$id" current
# Prune only after the switch succeeded. Protected releases count towards KEEP.
protected=" $id "
for p in "$@"; do
    case "$protected" in *" $p "*) ;; *) [ -d "releases/$p" ] && protected="$protected$p " ;; esac
done
slots=$keep
for p in $protected; do
    slots=$((slots - 1))
done
ids | LC_ALL=C sort -r | while read -r old; do
    case "$protected" in *" $old "*) continue ;; esac
    if [ "$slots" -gt 0 ]; then
        slots=$((slots - 1))
    else
        rm -rf -- "releases/$old"
    fi
done
