#!/usr/bin/env bash
# On a GPU machine staged by stage_local.sh: a kernel change against the code before it (the
# engine's batch-1 step) and the torch peer; then the server under load (EAGLE-3 against plain, 16
# and 64 slots; EAGLE-3 with --greedy-only), MT-Bench at batch 1, the offline continuous figure with
# the same slots (EOS ignored, as the server's requests do): the queue behind the GPU table of
# docs/serving.md. Carried as
# .stage/queue.sh with the serve extra's wheels (fastapi, starlette, pydantic, pydantic-core,
# annotated-types, typing-inspection, annotated-doc, opentelemetry-api, typing-extensions,
# uvicorn) installed into /tmp/site; launch.sh runs it. QUEUE=goals (in the queue's environment:
# the carried queue can set it) runs only what the serving and decode-step goals need; QUEUE=check
# a change's check beside kernel_base (the k = 6 step, the 16-slot servers, the offline figure);
# QUEUE=calls the cost of a device call apart from its steps (steps in calls of 64 and 16, servers
# with and without command buffers).
# QUEUE=tpot the 16-slot servers at 1 request/s only (the low-load TPOT goal).
# A server variant, set per `serve` call, tells what a change of the host loop is worth:
#   CODE=DIR    the server's code from DIR (holding eagle_jax/). The queue builds one (`overlay`)
#               from this tree with the files of /root/stage/base_overlay over it (carried: an
#               earlier commit's changed files, `git show COMMIT:PATH`, at their paths)
set -u
R=${RESULTS:?}; W=${WORK:-/root/work}; cd $W
export PYTHONPATH=/tmp/site:$W PYTHONUNBUFFERED=1
export EAGLE_JAX_MTBENCH=${EAGLE_JAX_MTBENCH:-/root/stage/mtbench_question.jsonl}
Q=${QUICK:-}  # QUICK=1: a few requests per setting, to try the queue on a CPU
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import jax, jaxlib, flax, fastapi, uvicorn; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  git -C /root/stage rev-parse HEAD 2>/dev/null; cat /root/stage/commit.txt 2>/dev/null; date -u
  echo "somaxconn $(cat /proc/sys/net/core/somaxconn)"; } > $R/device.txt 2>&1
listen_drops() {  # the kernel's counts of connections a full listen queue refused (TcpExt)
  python3 -c "
rows = [line.split() for line in open('/proc/net/netstat') if line.startswith('TcpExt:')]
values = dict(zip(rows[0][1:], rows[1][1:]))
print('listen overflows', values.get('ListenOverflows'), 'drops', values.get('ListenDrops'))"
}
cat $R/device.txt
port=8100
post() { python3 -c "import httpx, sys; httpx.post(sys.argv[1], timeout=300).raise_for_status()" "$1"; }
serve() {  # name slots rates concurrency [server flags...]: one server, Poisson rates (one call each), a closed loop
  local name=$1 slots=$2 rates=$3 conc=$4; shift 4
  port=$((port + 1))
  echo "== serve $name: $slots slots, flags: $*  ($(date -u +%T))"
  local code=${CODE:-$W}
  setsid env -C "$code" PYTHONPATH=/tmp/site:$code python3 -m eagle_jax.serve --dtype bfloat16 --max-num-seqs $slots --port $port "$@" \
    > $R/server_$name.log 2>&1 < /dev/null &
  local pid=$! began=$SECONDS
  python3 tools/gpu/wait_ready.py $port || { echo "server $name not ready"; tail -5 $R/server_$name.log; kill -- -$pid 2>/dev/null; return 1; }
  echo "ready after $((SECONDS - began)) s; $(grep -m1 "programs" $R/server_$name.log)"
  # The GPU's SM clock, power and load every 100 ms while the server is measured: at a low request
  # rate the GPU idles between requests, and a clock that drops there would slow every step.
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 100 \
    > $R/gpu_clocks_$name.csv 2>/dev/null &
  local clocks=$!
  for rate in ${rates//,/ }; do
    case $rate in 1) n=48;; 4) n=64;; 16) n=192;; *) n=384;; esac  # 48 at 1 request/s: TPOT p50s to set side by side
    [ -n "$Q" ] && n=3
    timeout 300 python3 benchmarks/serve_bench.py --url http://127.0.0.1:$port --request-rate $rate --num-prompts $n \
      --label "$name" --out $R/serve.json 2>&1 | grep -v -i warn | tail -1
  done
  if [[ " $* " == *" --profile-dir "* ]]; then  # four requests at 1 request/s under jax.profiler
    local trace_dir="" previous=""
    for flag in "$@"; do [ "$previous" = --profile-dir ] && trace_dir=$flag; previous=$flag; done
    post http://127.0.0.1:$port/start_profile
    timeout 120 python3 benchmarks/serve_bench.py --url http://127.0.0.1:$port --request-rate 1 --num-prompts 4 \
      --label "$name, traced" --out $R/serve.json 2>&1 | grep -v -i warn | tail -1
    post http://127.0.0.1:$port/stop_profile
    python3 tools/gpu/server_trace_summary.py $R $trace_dir  # its kernels a step against its run ms a step
  fi
  [ -n "$conc" ] && echo "before the closed loop: $(listen_drops)" && timeout 300 python3 benchmarks/serve_bench.py --url http://127.0.0.1:$port --concurrency $conc \
      --num-prompts $([ -n "$Q" ] && echo 4 || echo $((conc * 8))) --label "$name" --out $R/serve.json 2>&1 | grep -v -i warn | tail -1
  [ -n "$conc" ] && echo "after it: $(listen_drops)"
  python3 -c "import httpx, sys; print(httpx.get(f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" $port > $R/metrics_$name.txt 2>/dev/null || true
  kill $clocks 2>/dev/null
  kill -TERM $pid; wait $pid; echo "server exit $?"
}
off() {  # label slots [eagle.py flags...]: the offline continuous figure, 320 MT-Bench first turns of 256 tokens
  local label=$1 slots=$2; shift 2
  echo "== offline continuous, $slots slots, $label ($(date -u +%T))"
  timeout 400 python3 benchmarks/eagle.py --max_num_seqs $slots --scheduler continuous --num_prompts 320 \
    --max_new_tokens 256 --out $R/mtbench.json "$@" 2>&1 | grep -E "tok/s|tokens/s|Error" | tail -4
}
hf=${EAGLE_JAX_MODEL_DIR:-$(python3 -c "from eagle_jax.io import default_model; print(default_model.default_model_dir())")}
# A kernel change against the code before it (kernel_base, if carried: the earlier files at their
# paths over this tree), on this machine: the engine's batch-1 step of the real model (the
# server's k and 2048-slot cache), base and this tree alternated; the torch peer. The Pallas
# kernels are checked against XLA's after the 16-slot servers.
overlay() {  # overlay NAME: this tree's eagle_jax with /root/stage/NAME's files over it, in /root/stage/NAME.tree
  local dir=/root/stage/$1.tree
  rm -rf $dir && mkdir -p $dir && cp -r $W/eagle_jax $dir/ && cp -r /root/stage/$1/. $dir/ && echo $dir
}
kbase=""; kvariant=""  # kernel_variant, if carried: a second change to measure beside this tree's
[ -d /root/stage/kernel_base ] && kbase=$(overlay kernel_base)
[ -d /root/stage/kernel_variant ] && kvariant=$(overlay kernel_variant)
step() {  # label code [profile_step flags...]
  local label=$1 code=$2; shift 2
  echo "== step, batch 1, $label: $* ($(date -u +%T))"
  PYTHONPATH=/tmp/site:$code timeout 240 python3 benchmarks/profile_step.py --parts step_trace --decode-kernels pallas \
    --trace-steps 64 --cache-length 2048 --dtype bfloat16 --label "$label" --out $R/profile.json "$@" 2>&1 \
    | grep -E "step_trace|Error" | tail -2
}
if [ "${QUEUE:-full}" = goals ]; then
  # The goals' figures and nothing else: the batch-1 steps (plain, the shipped head's k = 6 and k = 4,
  # each beside kernel_base's), the peer, the 16-slot servers at 1 request/s and in a closed loop,
  # the offline figure with the same slots, MT-Bench at batch 1; then the steps' second pass.
  steps() {
    step "this tree" $W --method none
    [ -n "$kbase" ] && step "kernel base" $kbase --method none
    for k in 6 4; do
      step "this tree" $W --method eagle3 --k $k
      [ -n "$kbase" ] && step "kernel base" $kbase --method eagle3 --k $k
    done
  }
  steps
  echo "== torch peer ($(date -u +%T))"
  timeout 300 python3 /root/stage/torch_step_peer.py --model $hf --batch 1 --k 6 --max-len 2048 --out $R/torch_peer.jsonl \
    2>&1 | grep -v -i warn | tail -6
  serve eagle3-16 16 1 32 --method eagle3
  serve plain-16 16 1 32 --num-speculative-tokens 0
  off "EOS ignored" 16 --method eagle3,none --num_spec_tokens 4 --ignore_eos
  echo "== MT-Bench at batch 1, plain and EAGLE-3 k = 6 ($(date -u +%T))"
  timeout 300 python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 6 --num_prompts 80 --max_new_tokens 256 \
    --out $R/mtbench.json 2>&1 | grep -E "tok/s|tokens/s|Error" | tail -4
  steps
  echo "queue end $(date -u +%T)"
  echo BENCH DONE
  exit 0
fi
if [ "${QUEUE:-full}" = calls ]; then
  # Where a server's extra time a step at low load goes: the engine's batch-1 step in calls of 64
  # steps (what profile_step reports) and of 16 (the server's), with and without XLA's command
  # buffers (CUDA graphs); then the 16-slot EAGLE-3 server at 1 request/s with 16 and 64 steps a call.
  for method in "none" "eagle3 --k 6"; do
    for calls in 64 16; do step "$calls steps a call" $W --method $method --steps-per-call $calls; done
    XLA_FLAGS=--xla_gpu_enable_command_buffer= step "16 steps a call, no command buffers" $W --method $method \
      --steps-per-call 16
  done
  # XLA updates a program's command buffers (CUDA graphs) when its buffers' addresses change,
  # which a donated state's may do each call: the server without them tells what they cost.
  serve eagle3-16 16 1 "" --method eagle3
  XLA_FLAGS=--xla_gpu_enable_command_buffer= serve eagle3-16-no-command-buffers 16 1 "" --method eagle3
  serve eagle3-16-64-steps 16 1 "" --method eagle3 --steps-per-call 64
  echo "queue end $(date -u +%T)"
  echo BENCH DONE
  exit 0
fi
if [ "${QUEUE:-full}" = tpot ]; then
  # The low-load goal alone: the 16-slot EAGLE-3 and plain servers at 1 request/s (48 requests each).
  serve eagle3-16 16 1 "" --method eagle3
  serve plain-16 16 1 "" --num-speculative-tokens 0
  echo "queue end $(date -u +%T)"
  echo BENCH DONE
  exit 0
fi
if [ "${QUEUE:-full}" = check ]; then
  # A change's check in under ten minutes: the k = 6 step beside kernel_base's, the 16-slot servers
  # at 1 request/s and in a closed loop, the offline figure with the same slots, the steps again.
  ab() { step "this tree" $W --method eagle3 --k 6; [ -n "$kbase" ] && step "kernel base" $kbase --method eagle3 --k 6; }
  ab
  serve eagle3-16 16 1 32 --method eagle3
  serve plain-16 16 1 32 --num-speculative-tokens 0
  off "EOS ignored" 16 --method eagle3,none --num_spec_tokens 4 --ignore_eos
  ab
  echo "queue end $(date -u +%T)"
  echo BENCH DONE
  exit 0
fi
step "this tree" $W --method none
[ -n "$kbase" ] && step "kernel base" $kbase --method none
[ -n "$kvariant" ] && step "kernel variant" $kvariant --method none
step "this tree" $W --method eagle3 --k 4
echo "== torch peer ($(date -u +%T))"
timeout 300 python3 /root/stage/torch_step_peer.py --model $hf --batch 1 --k 4 --max-len 2048 --out $R/torch_peer.jsonl \
  2>&1 | grep -v -i warn | tail -6
# The server's requests ignore EOS (256 tokens each), so the like-for-like offline figure does too.
# Ordered by what the goals need first: EAGLE-3 at 16 slots (four of its requests traced), MT-Bench
# at batch 1, plain at 16 slots; the kernel check; the offline figure for the same slots; the kernel
# A/B's second pass; the base variant (if base_overlay is carried); --greedy-only; then 64 slots.
serve eagle3-16 16 1,4,16,64 32 --method eagle3 --profile-dir /root/stage/server_trace
serve eagle3-16-warm-start 16 "" "" --method eagle3  # the same programs again: loaded, not traced (its ready line)
echo "== MT-Bench at batch 1, plain and EAGLE-3 k = 6 ($(date -u +%T))"
timeout 300 python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 6 --num_prompts 80 --max_new_tokens 256 \
  --out $R/mtbench.json 2>&1 | grep -E "tok/s|tokens/s|Error" | tail -4
serve plain-16 16 1,64 32 --num-speculative-tokens 0
echo "== kernels checked against XLA ($(date -u +%T))"
timeout 200 python3 benchmarks/kernels_bench.py --check --rows 1,5 --tokens 1,5 --iterations 1 --trace-calls 1 \
  --out $R/kernels.json 2>&1 | grep -v -i warn | tail -12
off "EOS ignored" 16 --method eagle3,none --num_spec_tokens 4 --ignore_eos
[ -n "$kbase" ] && step "kernel base" $kbase --method eagle3 --k 4
step "this tree" $W --method none
[ -n "$kbase" ] && step "kernel base" $kbase --method none
[ -n "$kvariant" ] && step "kernel variant" $kvariant --method none
if [ -d /root/stage/base_overlay ]; then
  base=$(overlay base_overlay) && CODE=$base serve eagle3-16-base 16 1,64 32 --method eagle3
fi
serve eagle3-16-greedy-only 16 1 32 --method eagle3 --greedy-only
serve eagle3-64 64 1,64 128 --method eagle3
serve plain-64 64 1,64 128 --num-speculative-tokens 0
off "EOS ignored" 64 --method eagle3,none --num_spec_tokens 4 --ignore_eos
echo "queue end $(date -u +%T)"
echo BENCH DONE
