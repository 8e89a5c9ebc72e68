#!/usr/bin/env bash
# Installs Oracle MySQL (from Debian sid) into a chroot that the MySQL tests run `mysqld` from.
# Idempotent: a chroot that already has mysqld is kept. The mirror is read from this machine's
# apt sources, so nothing here names a host. Usage: bash .ci/mysql-chroot.sh [DIR]
set -euo pipefail
dir="${1:-/var/cache/dlock-ci/sid}"

have_mysqld() { ls "$dir"/usr/sbin/mysqld >/dev/null 2>&1 && [ -e "$dir/.dlock-ready" ]; }
if have_mysqld; then
  echo "mysql chroot: ready at $dir"
  exit 0
fi

mirror="$(grep -rhoE '^(URIs:|deb)[[:space:]]+(\[[^]]*\][[:space:]]+)?[a-z]+://[^[:space:]]+' \
  /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
  | grep -oE '[a-z]+://[^[:space:]]+' | grep -E '/debian/?$' | head -n1 || true)"
if [ -z "$mirror" ]; then
  echo "mysql chroot: no Debian mirror found in /etc/apt/sources.list*" >&2
  exit 1
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
fi

mkdir -p "$(dirname "$dir")"
if [ ! -x "$dir/usr/bin/apt-get" ]; then
  rm -rf "$dir"
  debootstrap --variant=minbase sid "$dir" "$mirror"
fi

# Oracle MySQL's server core: `mysql-server-core` (9.x), or else the newest versioned one.
# The mirror may lag the clock: do not refuse its Release file for its age.
chroot "$dir" apt-get -o Acquire::Check-Valid-Until=false update
pkg="$(chroot "$dir" apt-cache pkgnames mysql-server-core | grep -xE 'mysql-server-core(-[0-9.]+)?' \
  | sort -V | head -n1 || true)"
if [ -z "$pkg" ]; then
  echo "mysql chroot: Debian sid has no mysql-server-core package" >&2
  exit 1
fi
DEBIAN_FRONTEND=noninteractive chroot "$dir" apt-get install -y --no-install-recommends "$pkg"
chroot "$dir" /usr/sbin/mysqld --version
touch "$dir/.dlock-ready"
echo "mysql chroot: installed $pkg at $dir"
