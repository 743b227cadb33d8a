# shellcheck shell=sh
# Install one key's Mega-Cache artefact from the tar on stdin (fleet.compile_share.push), sent as
#   sh -c <this> fleet-compile-put ROOT KEY
# The tar lands in a scratch dir first; then the old manifest goes, the blob moves in, the new
# manifest last (renames in one filesystem): a reader never sees a manifest beside another blob.
root=$1
key=$2
tmp="$root/.incoming-$$"
mkdir -p -- "$tmp" "$root/$key" || exit 1
trap 'rm -rf -- "$tmp"' EXIT
tar -x -f - -C "$tmp" || exit 1
if [ ! -f "$tmp/megacache.bin" ] || [ ! -f "$tmp/manifest.json" ]; then
    printf 'compile artefact for %s arrived incomplete\n' "$key" >&2
    exit 3
fi
rm -f -- "$root/$key/manifest.json"
mv -f -- "$tmp/megacache.bin" "$root/$key/megacache.bin" || exit 1
mv -f -- "$tmp/manifest.json" "$root/$key/manifest.json"
