# shellcheck shell=sh
# Print an exported drafter folder as a base64 tar (fleet.export: `fab export --to`), sent as
#   sh -c <this> fleet-export-pack DIR
# base64 keeps the binary weights intact through the text channel commands' output uses.
# fleet: include contract
[ -f "$1/$HF_CONFIG_FILE" ] || { printf 'no exported drafter at %s\n' "$1" >&2; exit 3; }
tar -c -f - -C "$1" . | base64
