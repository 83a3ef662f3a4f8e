#!/usr/bin/env bash
# Waits up to $1 seconds for a background run writing $2 (a log) to print its DONE line (PIPELINE DONE,
# BENCH DONE, ...: a line of one capitalised word and DONE); shows progress.
limit=${1:-540}; log=${2:?log}; waited=0
while [ $waited -lt $limit ]; do
  grep -qE "^[A-Z_]+ DONE$" "$log" 2>/dev/null && break
  sleep 10; waited=$((waited + 10))
done
tr '\r' '\n' < "$log" | grep -v "^\s*$" | grep -v "Warning\|warn(" | tail -40
