#!/bin/bash
# Tear down a namespace made by ns-up.sh: ask its systemd to power off (units stop
# cleanly), make sure the PID namespace is gone (SIGKILL to its PID 1 kills everything
# in it), then remove its cgroup and state dir.  The overlay's upper layer is a tmpfs
# that only the namespace's mount table knew: it vanishes with it.  Idempotent.
# Usage: [NS_LAB=dir] ns-down.sh NAME
set -uo pipefail
NAME=${1:?usage: ns-down.sh NAME}; NS_LAB=${NS_LAB:-/tmp/perfectsched-systest}
NS_DIR=$NS_LAB/ns-$NAME
[ -d "$NS_DIR" ] || exit 0
P=$(cat "$NS_DIR/pid" 2>/dev/null || true)
U=$(cat "$NS_DIR/unshare.pid" 2>/dev/null || true)
S=$(cat "$NS_DIR/script.pid" 2>/dev/null || true)
CG=$(cat "$NS_DIR/cgroup" 2>/dev/null || true)
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
if alive "$P"; then
  # SIGRTMIN+4 to systemd as PID 1 == poweroff; in a container systemd then exits.
  kill -s SIGRTMIN+4 "$P" 2>/dev/null
  for _ in $(seq 100); do alive "$P" || break; sleep 0.1; done
  alive "$P" && kill -9 "$P" 2>/dev/null
fi
for _ in $(seq 50); do alive "$U" || break; sleep 0.1; done
alive "$U" && kill -9 "$U" 2>/dev/null
for _ in $(seq 30); do alive "$S" || break; sleep 0.1; done
alive "$S" && kill -9 "$S" 2>/dev/null
if [ -n "$CG" ] && [ -d "$CG" ]; then
  for _ in $(seq 50); do [ -s "$CG/cgroup.procs" ] || break; sleep 0.1; done
  find "$CG" -depth -type d -exec rmdir {} \; 2>/dev/null
  [ -d "$CG" ] && echo "ns-down.sh: warning: $CG still there" >&2
fi
if alive "$P" || alive "$U"; then
  echo "ns-down.sh: warning: namespace $NAME still alive (pid $P)" >&2; exit 1
fi
# only empty mount points and pid files are left on the host: remove them
rm -rf "$NS_DIR"
echo "ns-down.sh: $NAME down" >&2
