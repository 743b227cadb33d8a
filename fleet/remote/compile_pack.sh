# shellcheck shell=sh
# Print one key's Mega-Cache artefact (its blob, the optional files that are there, its manifest
# last) as a base64 tar (fleet.compile_share.pull), sent as
#   sh -c <this> fleet-compile-pack ROOT KEY BLOB MANIFEST [OPTIONAL...]
# (the file names are training/contract.py's, passed by the caller).
dir="$1/$2"
blob=$3
manifest=$4
shift 4
if [ ! -f "$dir/$manifest" ] || [ ! -f "$dir/$blob" ]; then
    printf 'no compile artefact at %s\n' "$dir" >&2
    exit 3
fi
for optional do  # keep the optional files that exist: positional parameters as the list
    shift
    if [ -f "$dir/$optional" ]; then set -- "$@" "$optional"; fi
done
tar -c -f - -C "$dir" "$blob" "$@" "$manifest" | base64
