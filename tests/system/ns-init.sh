#!/bin/bash
# PID 1 of a fresh PID namespace (started by ns-up.sh through `unshare`); never run by hand.
#
# Builds a throw-away root: overlayfs with lower = $ROOTFS (the host's / or a tree of
# rootfs.sh) and upper = a tmpfs, private /dev /proc /sys /run /tmp and a private cgroup2
# tree, pivot_root()s into it and exec()s the tree's /lib/systemd/systemd, which
# therefore IS pid 1 of the namespace.  Nothing written inside (dpkg, apt, sysusers,
# tmpfiles, the daemon's SQLite file) reaches the host or the cached tree: it all lands
# in the tmpfs upper layer and vanishes with the namespace.
# Every mount uses -n (no /run/mount/utab bookkeeping on the host's /run).
#
# Env (from ns-up.sh): NS_DIR  state dir on the host
#                      ROOTFS  the overlay's lower layer (read-only; default /)
#                      SHARE   host dir bind-mounted read-write at /srv/perfectsched-test
#                      TARGET  unit systemd boots into (default basic.target)
set -euo pipefail
NS_DIR=${NS_DIR:?}; SHARE=${SHARE:?}; TARGET=${TARGET:-basic.target}; ROOTFS=${ROOTFS:-/}
exec 8>&-   # ns-up.sh's hold on a cached tree: unshare, our parent, keeps it
R=$NS_DIR/root

mount -n --make-rprivate /
mkdir -p "$NS_DIR/layer" "$R"
mount -n -t tmpfs -o mode=755 psyslayer "$NS_DIR/layer"
mkdir -p "$NS_DIR/layer/upper" "$NS_DIR/layer/work"
mount -n -t overlay overlay \
  -o "lowerdir=$ROOTFS,upperdir=$NS_DIR/layer/upper,workdir=$NS_DIR/layer/work" "$R"

# --- API file systems -------------------------------------------------------------
mount -n -t proc proc "$R/proc"
# /proc/sys MUST stay read-only: otherwise systemd-sysctl.service inside writes Debian's
# sysctl.d values into the HOST kernel.  With it ro, systemd-sysctl/-binfmt skip
# themselves (ConditionPathIsReadWrite=/proc/sys/); they are masked below as well.
mount -n --bind "$R/proc/sys" "$R/proc/sys"; mount -n -o remount,bind,ro "$R/proc/sys"
if [ -e "$R/proc/sysrq-trigger" ]; then
  mount -n --bind "$R/proc/sysrq-trigger" "$R/proc/sysrq-trigger"
  mount -n -o remount,bind,ro "$R/proc/sysrq-trigger"
fi
mount -n --bind /sys "$R/sys"; mount -n -o remount,bind,ro "$R/sys"
# cgroup2 only, whatever the host has (hybrid v1+v2 here): systemd >= 256 refuses a
# hybrid hierarchy; a cgroup v1 controller of the host (memory) is missing inside.
mount -n -t cgroup2 cgroup2 "$R/sys/fs/cgroup"   # our cgroupns root = host .../unified/<ns>
mount -n -t tmpfs -o mode=755,nosuid,size=64m psysdev "$R/dev"
for n in null zero full random urandom tty; do
  touch "$R/dev/$n"; mount -n --bind "/dev/$n" "$R/dev/$n"
done
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -n -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -n -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
mount -n -t mqueue mqueue "$R/dev/mqueue" || true
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
# /dev/console: never the host's console; the pty of script(1) (-> console.log) if any.
touch "$R/dev/console"
if CON=$(tty 2>/dev/null); then mount -n --bind "$CON" "$R/dev/console"
else mount -n --bind "$NS_DIR/console.log" "$R/dev/console"; fi

mount -n -t tmpfs -o mode=755,nosuid,nodev,size=256m psysrun "$R/run"
mount -n -t tmpfs -o mode=1777,nosuid,nodev psystmp "$R/tmp"
# the exchange dir: NOT under /tmp (Debian's tmpfiles.d cleans /tmp at boot)
mkdir -p "$R/srv/perfectsched-test"; mount -n --bind "$SHARE" "$R/srv/perfectsched-test"

# --- per-boot identity, in the upper layer (the tree is never written) -------------
# A fresh machine-id (a rootfs.sh tree has an empty one; the host's is the host's), the
# hostname, and the host's resolver (host network; the image's resolv.conf may be a
# symlink into its /run, or absent).
tr -d - < /proc/sys/kernel/random/uuid > "$R/etc/machine-id"
echo perfectsched-ns > "$R/etc/hostname"
rm -f "$R/etc/resolv.conf"; cat /etc/resolv.conf > "$R/etc/resolv.conf"

# --- boot something small; never touch host-global state -------------------------
mkdir -p "$R/run/systemd" "$R/etc/systemd/system"
for u in systemd-sysctl.service systemd-binfmt.service systemd-modules-load.service \
         systemd-timesyncd.service systemd-time-wait-sync.service systemd-hwdb-update.service \
         systemd-networkd.service systemd-resolved.service systemd-firstboot.service \
         getty@tty1.service console-getty.service apt-daily.timer apt-daily-upgrade.timer; do
  ln -sf /dev/null "$R/etc/systemd/system/$u"
done
echo perfectsched-ns > "$R/run/systemd/container"
# Docker-style images ship a policy-rc.d that `exit 101`s, which stops maintainer
# scripts from starting services.  Remove it in the overlay only (host file untouched).
rm -f "$R/usr/sbin/policy-rc.d"

cd "$R"; mkdir -p .oldroot
pivot_root . .oldroot
umount -l /.oldroot; rmdir /.oldroot
cd /
exec env -i container=perfectsched-ns TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /lib/systemd/systemd --system --unit="$TARGET"
