#!/usr/bin/env bash
# Runs the staged queue on the GPU machine, detached, and polls it. From the repo root of a call's tree:
#   bash tools/gpu/launch.sh start [POLL_S]   in the last staging call, after setup.sh: copies
#                                              eagle_jax/, benchmarks/ and tools/ to $WORK_ROOT, starts
#                                              $STAGE_ROOT/queue.sh (carried as .stage/queue.sh) under
#                                              setsid, then polls it
#   bash tools/gpu/launch.sh poll [POLL_S]    every later call
# Both end by copying the console into $STAGE_ROOT/results and packing the results into $OUT
# (collect.sh). Their exit status is poll.sh's. The queue's environment (the model cache, the
# code's path) is set here, not taken from the caller: a call's shell does not keep what an
# earlier call's setup.sh exported, and without EAGLE_JAX_CACHE_DIR every run would look for the
# model online. The queue runs where setup.sh put it: once .stage is setup.sh's link to
# $STAGE_ROOT, copying .stage/queue.sh there would copy the file onto itself and fail.
set -euo pipefail
mode=${1:?start or poll}; limit=${2:-540}
stage=${STAGE_ROOT:-/root/stage}; work=${WORK_ROOT:-/root/work}; log=$stage/bench.log
tools=$(cd "$(dirname "$0")" && pwd)
case $mode in
  start)
    [ -f "$stage/queue.sh" ] || { echo "launch: no $stage/queue.sh: carry the queue as .stage/queue.sh" >&2; exit 2; }
    mkdir -p "$stage/results"
    # A restart keeps the earlier console beside the results (poll.sh would stop at its DONE line).
    [ -f "$log" ] && mv "$log" "$stage/results/bench_console.$(date -u +%H%M%S).txt"
    rm -rf "$work" && mkdir -p "$work" && cp -r eagle_jax benchmarks tools "$work/" && ln -sfn "$stage" "$work/.stage"
    (cd "$work" && PYTHONPATH=/tmp/site:$work PYTHONUNBUFFERED=1 EAGLE_JAX_CACHE_DIR=$stage/cache \
       RESULTS=$stage/results setsid nohup bash "$stage/queue.sh" > "$log" 2>&1 < /dev/null &) ;;
  poll) ;;
  *) echo "usage: $0 start|poll [POLL_S]" >&2; exit 2 ;;
esac
status=0
bash "$tools/poll.sh" "$limit" "$log" || status=$?
[ -f "$log" ] && mkdir -p "$stage/results" && cp "$log" "$stage/results/bench_console.txt"
bash "$tools/collect.sh" "$stage"
exit "$status"
