# shellcheck shell=sh
# The release `current` points at (fleet.deploy.current_release), sent as
#   sh -c <this> fleet-deploy-current WORKDIR MANIFEST
# Prints the prelude's sections `link` (the link's target; exit status 1 before the first deploy)
# and `manifest` (the release's MANIFEST file).
workdir=$1
manifest=$2
# fleet: include prelude.sh
section link readlink -- "$workdir/current"
section manifest cat -- "$workdir/current/$manifest"
exit 0
