# shellcheck shell=sh
# The release `current` points at (fleet.deploy.current_release), sent as
#   sh -c <this> fleet-deploy-current WORKDIR
# Prints the link's target, then `@@manifest` and the release's MANIFEST.json; prints nothing
# before the first deploy.
readlink -- "$1/current" || exit 0
printf '@@manifest\n'
cat -- "$1/current/MANIFEST.json"
