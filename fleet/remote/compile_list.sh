# shellcheck shell=sh
# The Mega-Cache artefacts under a compile-cache root (fleet.compile_share), sent as
#   sh -c <this> fleet-compile-list ROOT
# One line per key dir that holds both files: `@@key NAME BASE64-OF-manifest.json`.
root=$1
[ -d "$root" ] || exit 0
for dir in "$root"/*/; do
    if [ ! -f "${dir}manifest.json" ] || [ ! -f "${dir}megacache.bin" ]; then continue; fi
    name=$(basename -- "$dir")
    printf '@@key %s %s\n' "$name" "$(base64 < "${dir}manifest.json" | tr -d '\n')"
done
