# shellcheck shell=sh
# The Mega-Cache artefacts under a compile-cache root (fleet.compile_share), sent as
#   sh -c <this> fleet-compile-list ROOT MANIFEST ARTEFACT
# One prelude section `key NAME` per key dir that holds both files (MANIFEST and ARTEFACT, the
# names of training/compile/cache.py), its text the MANIFEST file.
root=$1
manifest=$2
artefact=$3
# fleet: include prelude.sh
[ -d "$root" ] || exit 0
for dir in "$root"/*/; do
    if [ ! -f "$dir$manifest" ] || [ ! -f "$dir$artefact" ]; then continue; fi
    name=$(basename -- "$dir")
    section "key $name" cat -- "$dir$manifest"
done
