#!/usr/bin/env bash
# Provides a Redis 8.4+ server for the Redis tests: Debian experimental's redis-server, installed
# in a minimal Debian sid chroot cached under /var/cache/dlock-ci/sid (about 800 MB, built once;
# later runs only check it). The tests run it through the `redis8-server` wrapper this script
# writes to /usr/local/bin. Idempotent; needs root and a Debian mirror in the apt sources.
set -euo pipefail
ROOT=/var/cache/dlock-ci/sid
WRAPPER=/usr/local/bin/redis8-server

if [ -x "$WRAPPER" ] && "$WRAPPER" --version 2>/dev/null | grep -Eq 'v=(8\.([4-9]|[1-9][0-9])|(9|[1-9][0-9])\.)'; then
    "$WRAPPER" --version
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    apt-get install -y -q debootstrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
fi
# The mirror this machine already uses, read from its apt sources (security suites excluded).
MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
    | grep -E '^(URIs:|deb )' | grep -v -- '-security' \
    | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; exit }}' || true)
if [ -z "$MIRROR" ]; then
    echo "no Debian mirror found in the apt sources" >&2
    exit 1
fi

mkdir -p /var/cache/dlock-ci
if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
    rm -rf "$ROOT"
    debootstrap --variant=minbase sid "$ROOT" "$MIRROR"
fi
echo "deb $MIRROR sid main" > "$ROOT/etc/apt/sources.list"
echo "deb $MIRROR experimental main" >> "$ROOT/etc/apt/sources.list"
# The mirror may be a snapshot older than the clock: do not reject its Release files as expired.
echo 'Acquire::Check-Valid-Until "false";' > "$ROOT/etc/apt/apt.conf.d/99dlock-no-valid-until"
chroot "$ROOT" apt-get update -q
chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -t experimental redis-server

# The server runs from the chroot's own libraries; its working directory and files are in the
# host's temp dir, which the wrapper makes visible inside the chroot at the same path.
mkdir -p "$ROOT/tmp"
cat > "$WRAPPER" <<WRAP
#!/bin/sh
# Redis 8.4+ from the Debian experimental chroot $ROOT (written by .ci/redis8-chroot.sh).
exec env LD_LIBRARY_PATH="$ROOT/lib/x86_64-linux-gnu:$ROOT/usr/lib/x86_64-linux-gnu" \
    "$ROOT/lib64/ld-linux-x86-64.so.2" "$ROOT/usr/bin/redis-server" "\$@"
WRAP
chmod +x "$WRAPPER"
"$WRAPPER" --version
