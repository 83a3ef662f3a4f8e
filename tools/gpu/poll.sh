#!/usr/bin/env bash
# Waits up to $1 seconds for a background run writing $2 (a log) to print its DONE line (PIPELINE DONE,
# BENCH DONE, ...: a line of one capitalised word and DONE); shows progress. Exits 1 at once if the
# log is still missing $POLL_GRACE_S (default 30) seconds on: nothing was launched.
limit=${1:-540}; log=${2:?log}; grace=${POLL_GRACE_S:-30}; waited=0
while [ $waited -lt $limit ]; do
  grep -qE "^[A-Z_]+ DONE$" "$log" 2>/dev/null && break
  # No log after the grace period: nothing was launched, so fail now rather than wait out the limit.
  [ -f "$log" ] || [ $waited -lt $grace ] || { echo "poll: no $log after $grace s: was the job launched?" >&2; exit 1; }
  sleep 10; waited=$((waited + 10))
done
tr '\r' '\n' < "$log" | grep -v "^\s*$" | grep -v "Warning\|warn(" | tail -40
