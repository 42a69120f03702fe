#!/bin/bash
# Boot a real systemd as PID 1 of a private PID/mount/UTS/IPC/cgroup namespace on a
# throw-away overlay of a Debian root file system (see ns-init.sh): the host's own /
# (default), or another release's tree built and cached by rootfs.sh (ROOTFS=trixie:
# Debian 13 with systemd 257, on a Debian 12 host).  Shares the host network, so apt
# works inside.  Root only.  Boot to basic.target takes well under a second.
#
# Usage:  [ROOTFS=/|SUITE|/dir] [NS_LAB=dir] [SHARE=dir] ns-up.sh NAME [TARGET]
#   ROOTFS: / the host's root; a suite name (trixie): rootfs.sh's cached tree of it;
#           any other absolute directory: that tree (never written: the lower layer)
#   prints the host PID of the namespace's PID 1 on stdout (a boot line on stderr);
#   run commands inside with:  nsenter -t PID -a CMD...
#   tear down with:            ns-down.sh NAME     (always safe to call, idempotent)
# State lives in $NS_LAB/ns-NAME (default NS_LAB=/tmp/perfectsched-systest).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=${1:?usage: ns-up.sh NAME [TARGET]}; TARGET=${2:-basic.target}
NS_LAB=${NS_LAB:-/tmp/perfectsched-systest}
ROOTFS=${ROOTFS:-/}
export NS_DIR=$NS_LAB/ns-$NAME SHARE=${SHARE:-$NS_LAB/share-$NAME} TARGET
[ "$(id -u)" = 0 ] || { echo "ns-up.sh: must run as root" >&2; exit 1; }
for tool in unshare nsenter script setsid pgrep flock; do
  command -v "$tool" >/dev/null || { echo "ns-up.sh: missing $tool" >&2; exit 1; }
done
case $ROOTFS in
  /) ;;
  /*) ROOTFS=$(cd "$ROOTFS" && pwd -P) ;;
  *) # a suite: rootfs.sh's tree, held (shared lock, for the namespace's life: the
     # unshare process below inherits fd 8) so that it is neither rebuilt nor removed
     # under the overlay; taken again if it went between rootfs.sh and the lock
     for _ in 1 2 3; do
       tree=$("$HERE/rootfs.sh" "$ROOTFS")
       exec 8<>"$tree.lock"; flock -s 8
       [ -f "$tree.stamp" ] && break
       exec 8>&-; tree=
     done
     [ -n "$tree" ] || { echo "ns-up.sh: no usable $ROOTFS tree" >&2; exit 1; }
     ROOTFS=$tree ;;
esac
[ -x "$ROOTFS/lib/systemd/systemd" ] || {
  echo "ns-up.sh: no systemd in $ROOTFS (/lib/systemd/systemd)" >&2; exit 1; }
export ROOTFS
mkdir -p "$NS_DIR" "$SHARE"; : > "$NS_DIR/console.log"

# A private cgroup2 subtree (the host may be hybrid v1+v2: use the unified mount).
if [ -f /sys/fs/cgroup/unified/cgroup.procs ]; then CGROOT=/sys/fs/cgroup/unified
elif [ -f /sys/fs/cgroup/cgroup.procs ]; then CGROOT=/sys/fs/cgroup
else echo "ns-up.sh: no cgroup2 hierarchy" >&2; exit 1; fi
CG=$CGROOT/perfectsched-ns-$NAME
mkdir -p "$CG"; echo "$CG" > "$NS_DIR/cgroup"; echo "$ROOTFS" > "$NS_DIR/rootfs"

NETFLAG=; [ "${NET:-host}" = private ] && NETFLAG=--net
start=$(date +%s%N)
# setsid: own session; script(1): a pty that becomes the namespace's /dev/console
# (boot messages land in console.log).  The inner shell moves itself into $CG, then
# unshare(2)s with --cgroup so $CG is "/" inside, and forks ns-init.sh as PID 1.
INNER="echo \$\$ > $CG/cgroup.procs; echo \$\$ > $NS_DIR/unshare.pid; exec unshare --pid --fork --mount --uts --ipc --cgroup $NETFLAG --propagation private $HERE/ns-init.sh"
setsid script -qfec "$INNER" "$NS_DIR/console.log" >/dev/null 2>&1 </dev/null &
echo $! > "$NS_DIR/script.pid"

P=
for _ in $(seq 200); do
  U=$(cat "$NS_DIR/unshare.pid" 2>/dev/null || true)
  [ -n "$U" ] && P=$(pgrep -P "$U" | head -1 || true)
  [ -n "$P" ] && break; sleep 0.05
done
if [ -z "$P" ]; then
  echo "ns-up.sh: namespace did not start; console:" >&2; cat "$NS_DIR/console.log" >&2
  "$HERE/ns-down.sh" "$NAME" >/dev/null 2>&1 || true; exit 1
fi
echo "$P" > "$NS_DIR/pid"
st=
for _ in $(seq 600); do
  st=$(nsenter -t "$P" -a systemctl is-system-running 2>/dev/null || true)
  case "$st" in running|degraded) break;; esac
  kill -0 "$P" 2>/dev/null || break
  sleep 0.1
done
case "$st" in running|degraded) ;; *)
  echo "ns-up.sh: systemd in the namespace did not boot (state '$st'); console:" >&2
  tail -50 "$NS_DIR/console.log" >&2
  "$HERE/ns-down.sh" "$NAME" >/dev/null 2>&1 || true; exit 1;;
esac
release=$(nsenter -t "$P" -a sh -c '. /etc/os-release; echo "$PRETTY_NAME"' || true)
echo "ns-up.sh: $NAME: $release (root $ROOTFS), PID 1 = host pid $P, state=$st, boot $(( ($(date +%s%N) - start) / 1000000 )) ms" >&2
echo "$P"
