#!/usr/bin/env bash
# Runs the README's demo (the `sh` block of "## The example service") as written: two instances
# of the example service, a slow debit on one, and the 409 problem from the other. Its lock and
# ledger files go to a temporary directory (DLOCK_URL, LEDGER_DB); the block itself is not
# changed. Fails unless the 409 problem is answered. Run from anywhere: `bash .ci/readme-demo.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

demo="$(awk '/^## The example service/ { found = 1 }
             found && /^```sh$/ { inside = 1; next }
             inside && /^```$/ { exit }
             inside { print }' README.md)"
if [ -z "$demo" ]; then
  echo "the README has no sh block under '## The example service'"
  exit 1
fi

tmp="$(mktemp -d)"
export DLOCK_URL="sqlite://$tmp/locks.db" LEDGER_DB="$tmp/ledger.db"
# The demo in a session of its own, so that whatever it leaves running (a server, if it
# failed half-way) is ended with it.
setsid bash -euo pipefail -c "$demo" >"$tmp/out.txt" 2>&1 &
demo_pid=$!
status=0
timeout 600 tail --pid="$demo_pid" -f /dev/null || status=$?
wait "$demo_pid" || status=$?
kill -- "-$demo_pid" 2>/dev/null || true

grep -v '^\s*\(Compiling\|Finished\|Running\|Blocking\)' "$tmp/out.txt" | tail -n 20
if [ "$status" -ne 0 ]; then
  echo "the README's demo failed (exit $status)"
  exit 1
fi
for expected in 'HTTP/1.1 409 Conflict' 'content-type: application/problem+json' \
    '"code":"DistributedLock.AlreadyHeld"' '"balance":99'; do
  if ! grep -qF "$expected" "$tmp/out.txt"; then
    echo "the README's demo did not answer $expected"
    exit 1
  fi
done
rm -rf "$tmp"
echo "the README's demo ran as written"
