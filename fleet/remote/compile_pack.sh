# shellcheck shell=sh
# Print one key's Mega-Cache artefact (its blob, then its manifest) as a base64 tar
# (fleet.compile_share.pull), sent as   sh -c <this> fleet-compile-pack ROOT KEY
dir="$1/$2"
if [ ! -f "$dir/manifest.json" ] || [ ! -f "$dir/megacache.bin" ]; then
    printf 'no compile artefact at %s\n' "$dir" >&2
    exit 3
fi
tar -c -f - -C "$dir" megacache.bin manifest.json | base64
