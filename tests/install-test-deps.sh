#!/bin/bash
# Install the Debian 12 packages that `make test` (and later `make deb`) need.
#
#   - PostgreSQL 15 and MariaDB servers: tests/dbservers.py starts throw-away instances
#   - promtool (package prometheus: Debian 12 has no smaller package providing it)
#   - dbus-daemon, setpriv/runuser
#   - Debian's own Python libraries, for the `make test-debian` run against Debian 12's versions
#   - the Debian packaging toolchain (and packaging/debian/control's Build-Depends, if present)
#   - mmdebstrap: tests/system/rootfs.sh builds the Debian 13 tree the system tests boot
#   - Chromium, its driver and Selenium: the web console's browser test
#
# Idempotent: when everything is installed it only runs one dpkg-query (well under 1 s).
# Needs root (or passwordless sudo) when something is missing.  Never starts a service:
# if the machine has no /usr/sbin/policy-rc.d, a temporary one (exit 101) is put in
# place for the duration of the install.
set -euo pipefail

cd "$(dirname "$0")/.."

PACKAGES=(
  # database servers and system tools used by the tests
  postgresql mariadb-server prometheus dbus util-linux bash-completion strace
  # the database failover test (tests/faults/test_faults_failover.py): etcd + Patroni
  patroni etcd-server
  # Debian's Python stack (make test-debian)
  python3-venv python3-wheel python3-sqlalchemy python3-croniter python3-yaml
  python3-prometheus-client python3-sdnotify python3-dbus-next python3-psycopg
  python3-psycopg2 python3-pymysql python3-pytest python3-pytest-xdist
  # packaging toolchain (make deb)
  build-essential fakeroot debhelper dh-python pybuild-plugin-pyproject python3-setuptools
  python3-all lintian devscripts
  # the Debian 13 root file system of the system tests (tests/system/rootfs.sh); the
  # keyring has trixie's keys
  mmdebstrap debian-archive-keyring
  # the web console's browser test (tests/web/test_console_browser.py), and the remote
  # CLI's and the listener's HTTPS tests (a throw-away certificate)
  chromium chromium-driver python3-selenium openssl curl
)

missing_packages() {
  # One dpkg-query for all: it prints nothing (and complains on stderr) for unknown ones.
  local installed
  installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null \
              | awk '$2 == "installed" {print $1}' || true)
  local p
  for p in "${PACKAGES[@]}"; do
    grep -qxF "$p" <<<"$installed" || printf '%s\n' "$p"
  done
}

# Build-Depends of our own Debian package that are not installed (empty if none, or
# if there is no packaging/debian/control yet).
build_deps_unmet() {
  [ -f packaging/debian/control ] || return 1
  command -v dpkg-checkbuilddeps >/dev/null || return 0
  ! (cd packaging && dpkg-checkbuilddeps >/dev/null 2>&1)
}

mapfile -t MISSING < <(missing_packages)
NEED_BUILD_DEPS=0
if build_deps_unmet; then NEED_BUILD_DEPS=1; fi

if [ "${#MISSING[@]}" -eq 0 ] && [ "$NEED_BUILD_DEPS" = 0 ]; then
  exit 0
fi

SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "install-test-deps: missing packages: ${MISSING[*]}" >&2
    echo "install-test-deps: run this script as root (or with passwordless sudo)" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS
[ "${#MISSING[@]}" -eq 0 ] || echo "install-test-deps: installing: ${MISSING[*]}" >&2
[ "$NEED_BUILD_DEPS" = 0 ] || echo "install-test-deps: installing packaging/debian/control Build-Depends" >&2

# Never let a postinst start a service (the servers are started by the tests themselves).
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null
  "${SUDO[@]}" chmod 755 "$POLICY"
  trap '"${SUDO[@]}" rm -f "$POLICY"' EXIT
fi

APT=("${SUDO[@]}" apt-get -qq -o DPkg::Lock::Timeout=600 -o Dpkg::Use-Pty=0)

apt_update() {
  local i
  for i in 1 2 3 4 5; do
    "${APT[@]}" update && return 0
    echo "install-test-deps: apt-get update failed (try $i), retrying" >&2
    sleep $((i * 5))
  done
  return 1
}

LOG=$(mktemp /tmp/install-test-deps.XXXXXX.log)
run_logged() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "install-test-deps: failed: $*" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

apt_update
if [ "${#MISSING[@]}" -gt 0 ]; then
  # Keep existing config files; no recommends: they double the size.
  run_logged "${APT[@]}" install -y --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${MISSING[@]}"
fi
if build_deps_unmet; then
  run_logged "${APT[@]}" build-dep -y --no-install-recommends ./packaging
fi
rm -f "$LOG"

# Sanity: the binaries the tests look for.
for f in /usr/lib/postgresql/15/bin/initdb /usr/lib/postgresql/15/bin/postgres \
         /usr/sbin/mariadbd /usr/bin/mariadb-install-db /usr/bin/promtool \
         /usr/bin/dbus-daemon /usr/bin/setpriv /usr/sbin/runuser /usr/bin/mmdebstrap \
         /usr/bin/patroni /usr/bin/etcd; do
  [ -x "$f" ] || { echo "install-test-deps: $f is missing after install" >&2; exit 1; }
done
echo "install-test-deps: done in $((SECONDS - T0)) s" >&2
