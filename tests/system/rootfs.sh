#!/bin/bash
# The root file system of another Debian release for the system tests' namespace
# (ns-up.sh ROOTFS=SUITE): built once with mmdebstrap from the Debian archive, then
# reused.  Default suite: trixie (Debian 13, systemd 257), on a Debian 12 host.
#
# Usage:  [ROOTFS_CACHE=dir] [MIRROR=url] [SECURITY_MIRROR=url] [REBUILD=1] rootfs.sh [SUITE]
#   prints the tree's directory on stdout (log lines on stderr).  Root only.
#
# The tree: variant minbase (Priority required, apt) plus what the tests run inside that
# the package does not bring: systemd and dbus (PID 1, the system bus), procps (the tests'
# pgrep, ps, kill), man-db (`systemd-analyze verify` runs `man` for the unit's
# Documentation=man: lines).  Nothing else: the package's own dependencies (python3,
# polkitd, ...) come from the archive when the test installs the .deb, as on a real
# system.  apt's package lists are kept (`apt-get install ./x.deb` works without an
# `apt-get update`; when they have gone stale the tests update them, in the overlay).
#
# The cache, $ROOTFS_CACHE/SUITE-KEY (default /var/cache/perfectsched-ns), is keyed by a
# hash of what makes the tree (suite, mirrors, package list, mmdebstrap version, this
# script's hook): change one and a new tree is built beside the old ones, which stay
# until no namespace uses them (then they are removed).  A tree is built in KEY.new and
# renamed into place: a half-built tree is never used, and a tree never changes once
# built.  REBUILD=1 builds the current key again (refused while a namespace uses it).
#
# Locks ($DIR.lock, flock): the builder holds it exclusively; ns-up.sh holds it shared
# for a namespace's whole life (its unshare process keeps the descriptor), so a tree
# under a running overlay is never changed or removed (overlayfs: undefined).
#
# Needs mmdebstrap and debian-archive-keyring (tests/install-test-deps.sh installs both;
# bookworm's keyring has trixie's keys) and the archive over the network.  First build
# ~15 s and ~180 MB; a reuse ~0.1 s.
set -euo pipefail
SUITE=${1:-trixie}
CACHE=${ROOTFS_CACHE:-/var/cache/perfectsched-ns}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PACKAGES=systemd,dbus,procps,man-db
[ "$(id -u)" = 0 ] || { echo "rootfs.sh: must run as root" >&2; exit 1; }
command -v mmdebstrap >/dev/null || {
  echo "rootfs.sh: mmdebstrap is missing (tests/install-test-deps.sh installs it)" >&2; exit 1; }

SOURCES=("deb $MIRROR $SUITE main")
case $SUITE in sid|unstable|experimental) ;;   # no -updates, no -security
  *) SOURCES+=("deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main");;
esac
# The image leaves no identity: ns-init.sh writes machine-id, hostname and resolv.conf
# into each namespace's overlay at boot.
HOOK='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"; : > "$1/etc/machine-id"'
STAMP=$(printf '%s\n' "suite=$SUITE" "variant=minbase" "packages=$PACKAGES" "${SOURCES[@]}" \
        "hook=$HOOK" "$(mmdebstrap --version)")
KEY=$(sha256sum <<<"$STAMP" | cut -c1-12)
DIR=$CACHE/$SUITE-$KEY
mkdir -p "$CACHE"

if [ "${REBUILD:-0}" != 1 ] && [ -f "$DIR.stamp" ]; then   # the stamp is written last
  echo "$DIR"; exit 0
fi
exec 9<>"$DIR.lock"
if [ "${REBUILD:-0}" = 1 ]; then
  flock -n -x 9 || { echo "rootfs.sh: $DIR is in use by a namespace (or being built)" >&2
                     exit 1; }
  rm -f "$DIR.stamp"
else
  flock -x 9
  [ -f "$DIR.stamp" ] && { echo "$DIR"; exit 0; }   # built by the caller we waited for
fi

NEW=$DIR.new; rm -rf "$NEW" "$DIR"
start=$(date +%s%N)
echo "rootfs.sh: building $DIR ($SUITE: minbase + $PACKAGES) with mmdebstrap" >&2
# --mode=root: we are root, a plain chroot.  --skip=cleanup/apt/lists keeps the lists.
if ! mmdebstrap --mode=root --variant=minbase --include="$PACKAGES" --components=main \
     --aptopt='Acquire::Languages "none"' --skip=cleanup/apt/lists \
     --customize-hook="$HOOK" "$SUITE" "$NEW" "${SOURCES[@]}" > "$DIR.build.log" 2>&1; then
  tail -30 "$DIR.build.log" >&2
  echo "rootfs.sh: mmdebstrap failed; log: $DIR.build.log" >&2
  rm -rf "$NEW"; exit 1
fi
mv "$NEW" "$DIR"
took=$(( ($(date +%s%N) - start) / 1000000 ))
systemd=$(chroot "$DIR" dpkg-query -W -f='${Version}' systemd)
size=$(du -sh "$DIR" | cut -f1)
printf '%s\n# built %s in %s ms, %s, systemd %s\n' "$STAMP" "$(date -u +%FT%TZ)" "$took" \
  "$size" "$systemd" > "$DIR.stamp.tmp"
mv "$DIR.stamp.tmp" "$DIR.stamp"
echo "rootfs.sh: built $DIR in $((took / 1000)) s ($size, systemd $systemd)" >&2

# Older trees of this suite (another key) that no namespace holds: removed.
for old in "$CACHE/$SUITE"-*.lock; do
  other=${old%.lock}
  [ "$other" = "$DIR" ] && continue
  if ( flock -n -x 8 || exit 1; rm -rf "$other" "$other.new" "$other.stamp" \
       "$other.build.log"; rm -f "$old" ) 8<>"$old"; then
    echo "rootfs.sh: removed the older tree $other" >&2
  fi
done
echo "$DIR"
