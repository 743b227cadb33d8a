# shellcheck shell=sh
# Install one key's Mega-Cache artefact from the tar on stdin (fleet.compile_share.push), sent as
#   sh -c <this> fleet-compile-put ROOT KEY BLOB MANIFEST [OPTIONAL...]
# (the file names are training/contract.py's, passed by the caller). The tar lands in a scratch
# dir first; then the old manifest goes, the blob and the optional files move in (an optional
# file the new artefact lacks is removed: it belonged to the old one), the new manifest last
# (renames in one filesystem): a reader never sees a manifest beside another blob.
root=$1
key=$2
blob=$3
manifest=$4
shift 4
tmp="$root/.incoming-$$"
mkdir -p -- "$tmp" "$root/$key" || exit 1
trap 'rm -rf -- "$tmp"' EXIT
tar -x -f - -C "$tmp" || exit 1
if [ ! -f "$tmp/$blob" ] || [ ! -f "$tmp/$manifest" ]; then
    printf 'compile artefact for %s arrived incomplete\n' "$key" >&2
    exit 3
fi
rm -f -- "$root/$key/$manifest"
mv -f -- "$tmp/$blob" "$root/$key/$blob" || exit 1
for optional do
    if [ -f "$tmp/$optional" ]; then
        mv -f -- "$tmp/$optional" "$root/$key/$optional" || exit 1
    else
        rm -f -- "$root/$key/$optional"
    fi
done
mv -f -- "$tmp/$manifest" "$root/$key/$manifest"
