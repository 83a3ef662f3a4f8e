#!/usr/bin/env bash
# Decode-step levers with no model to stage: SmolLM2-135M's shapes with random target weights and the
# shipped EAGLE-3 head (step times do not depend on the weights), against the torch peer on random
# weights of the same shapes, on the same GPU. Run from the repo root of a device call that carries
# .stage/ holding smollm2_config.json and torch_step_peer.py:
#   bash tools/gpu/step_levers.sh base     plain and EAGLE-3 k = 6 steps, the draft loop written out, the peer
#   bash tools/gpu/step_levers.sh pdl      the same steps under XLA's programmatic dependent launch flag
#   bash tools/gpu/step_levers.sh repeat   plain, k = 6 and k = 6 written out, twice each, in alternation
#   bash tools/gpu/step_levers.sh cache    plain and k = 6 on caches of one length (1024; plain at 512 too, as the
#                                          peer's), Pallas and XLA kernels
#   bash tools/gpu/step_levers.sh peer     the peer alone (PEER_MAX_LEN: its cache, default 512)
#   bash tools/gpu/step_levers.sh serve    the 16-slot EAGLE-3 server (k = 4) on a model of these shapes with random
#                                          weights (benchmarks/random_model.py) and the shipped head: its run ms a
#                                          step at 1 request/s and a closed loop of 32 clients, four requests
#                                          traced; restarted warm with --engine-in-process, the same two loads;
#                                          then the engine's own k = 4 step on the same cache (needs
#                                          .stage/mtbench_question.jsonl)
#   bash tools/gpu/step_levers.sh saturation  the same server's closed loop (32 clients) against the offline continuous
#                                          figure on the same model and slots, the engine in its own process and in
#                                          the HTTP process, alternated; the SM clock while it takes 1 request/s
#   bash tools/gpu/step_levers.sh shipped  plain, then EAGLE-3 k = 6 and k = 4 with the shipped head, on a 2048-slot cache
#   bash tools/gpu/step_levers.sh draft    the draft head's kernels (final norm + lm_head with float32 logits, bf16 or int8, input
#                                          norms + q/k/v, gate_up, split-K down_proj) in Pallas against XLA's, one
#                                          row, a sweep of column and K blocks, L2 evicted
#   bash tools/gpu/step_levers.sh persistent  the decoder stack as one persistent kernel against the fused kernels
#                                          (benchmarks/persistent_bench.py: barriers polled with volatile loads or
#                                          atomics; each stage left out in turn, and all of them: the barriers alone)
#   bash tools/gpu/step_levers.sh chain    chains of dependent kernels: Pallas Triton against Mosaic GPU with and without
#                                          programmatic dependent launch, sum links and 576 x 576 projections
#                                          (benchmarks/pdl_chain_bench.py)
#   bash tools/gpu/step_levers.sh calls    what a device call costs besides its steps (benchmarks/call_overhead.py)
#   bash tools/gpu/step_levers.sh barrier  the persistent kernels' grid barrier alone (benchmarks/grid_barrier_bench.py:
#                                          wrong values read across it, us a barrier, either spin) on 1-132 programs, then the
#                                          persistent kernel on a small two-layer config at 1-32 programs
#   bash tools/gpu/step_levers.sh ab       a kernel change: plain (AB_PASSES times, default 2, alternated) and k = 6 steps of this tree
#                                          and of it with .stage/kernel_base's files over it (an earlier commit's,
#                                          at their paths), on a 2048-slot cache; k = 6 with .stage/kernel_variant's
#                                          files over this tree too, if carried
# Rows go to $OUT/profile.json and $OUT/torch_peer.jsonl; the console to $OUT/console_<phase>.txt.
set -uo pipefail
phase=${1:?base, pdl, repeat, cache, peer, serve, saturation, shipped, draft, persistent, barrier, chain, calls or ab}
out=${OUT:?}; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 EAGLE_JAX_CACHE_DIR=/tmp/eagle_jax_cache
exec > >(tee -a "$out/console_$phase.txt") 2>&1
config=.stage/smollm2_config.json
[ -f /tmp/device.txt ] || {
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import jax, jaxlib, flax, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'torch', torch.__version__)"
} > /tmp/device.txt 2>&1
cp /tmp/device.txt "$out/device.txt"; cat /tmp/device.txt
prof() {  # label, then profile_step flags; EAGLE-3 steps run the shipped head (a random target alone would
  # otherwise get a random head of profile_step's own shape: 8,192 draft tokens, the target's MLP width)
  local label=$1; shift
  local draft=(); [[ " $* " == *" eagle3 "* ]] && draft=(--draft eagle_jax/heads/smollm2-135m-instruct-eagle3)
  timeout 200 python3 benchmarks/profile_step.py --parts step_trace --decode-kernels pallas --random-target "$config" \
    --trace-steps 64 --top-kernels 30 --out "$out/profile.json" --label "$label" "$@" "${draft[@]}" 2>&1 \
    | grep -E "\] step_trace|Error|error" | tail -3
}
peer() {  # the torch peer on random weights of the same shapes, on this GPU
  echo "== torch peer on random weights of the same shapes (torch.compile reduce-overhead + CUDA graphs)"
  python3 - <<'EOF'
import json, torch, transformers
config = transformers.LlamaConfig(**{k: v for k, v in json.load(open(".stage/smollm2_config.json")).items()
                                     if k not in ("architectures", "torch_dtype")})
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained("/tmp/peer_model", safe_serialization=True)
print("random peer model saved")
EOF
  timeout 300 python3 .stage/torch_step_peer.py --model /tmp/peer_model --batch 1 --k 6 --max-len ${PEER_MAX_LEN:-512} \
      --out "$out/torch_peer.jsonl" 2>&1 | grep -v -i warn | tail -8
}
serve_once() {  # label [serve flags...]: starts the server, waits for /health, prints its ready line; leaves it running
  local label=$1; shift
  python3 -m eagle_jax.serve --model /tmp/random_model/model --draft eagle_jax/heads/smollm2-135m-instruct-eagle3 \
    --dtype bfloat16 --max-num-seqs 16 --max-length 2048 --port 8200 "$@" > "/tmp/server_$label.log" 2>&1 &
  server=$!  # its log stays on the machine ($OUT takes 8 files); its ready line goes to the console
  python3 tools/gpu/wait_ready.py 8200 || { echo "server not ready"; tail -5 "/tmp/server_$label.log"; }
  echo "$label: $(grep -m1 "ready after" "/tmp/server_$label.log")"
}
bench() {  # label, then serve_bench flags: load on the server serve_once started
  local label=$1; shift
  timeout 200 python3 benchmarks/serve_bench.py --url http://127.0.0.1:8200 --label "$label" --out "$out/serve.json" \
    "$@" 2>&1 | grep -v -i warn | tail -1
}
shipped_steps() {  # plain, then the shipped EAGLE-3 head's k = 6 and k = 4, on a 2048-slot cache
  prof "plain" --method none --cache-length 2048
  prof "eagle3 k=6, the shipped head" --method eagle3 --k 6 --cache-length 2048
  prof "eagle3 k=4, the shipped head" --method eagle3 --k 4 --cache-length 2048
}
case $phase in
  serve)
    export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
    [ -d /tmp/random_model/model ] || python3 benchmarks/random_model.py --config "$config" --out /tmp/random_model
    serve_once cold --profile-dir /tmp/server_trace
    bench "eagle3 k=4, 16 slots, random weights, engine process" --request-rate 1 --num-prompts 16
    bench "eagle3 k=4, 16 slots, random weights, engine process" --concurrency 32 --num-prompts 128
    python3 -c "import httpx; httpx.post('http://127.0.0.1:8200/start_profile', timeout=300).raise_for_status()"
    bench "eagle3 k=4, 16 slots, random weights, engine process, traced" --request-rate 1 --num-prompts 4
    python3 -c "import httpx; httpx.post('http://127.0.0.1:8200/stop_profile', timeout=300).raise_for_status()"
    python3 tools/gpu/server_trace_summary.py "$out" /tmp/server_trace  # its kernels a step against its run ms a step
    cp "$(find /tmp/server_trace -name '*.trace.json.gz' | head -1)" "$out/server_trace.json.gz"
    kill -TERM $server; wait $server
    serve_once warm-in-process --engine-in-process
    bench "eagle3 k=4, 16 slots, random weights, engine in the HTTP process" --request-rate 1 --num-prompts 16
    bench "eagle3 k=4, 16 slots, random weights, engine in the HTTP process" --concurrency 32 --num-prompts 128
    kill -TERM $server; wait $server
    prof "eagle3 k=4, the engine's step, random weights" --method eagle3 --k 4 --cache-length 2048 ;;
  saturation)
    # The server's closed loop against the offline continuous figure on the same model, slots and
    # machine, with the engine in its own process and in the HTTP process (alternated); the GPU's
    # SM clock every 100 ms while the server takes 1 request/s.
    export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
    [ -d /tmp/random_model/model ] || python3 benchmarks/random_model.py --config "$config" --out /tmp/random_model
    head=eagle_jax/heads/smollm2-135m-instruct-eagle3
    echo "== offline continuous, 16 slots, EAGLE-3 k = 4, 320 prompts of 256 tokens, EOS ignored"
    timeout 300 python3 benchmarks/eagle.py --model /tmp/random_model/model --draft $head --method eagle3 \
      --num_spec_tokens 4 --max_num_seqs 16 --scheduler continuous --num_prompts 320 --max_new_tokens 256 \
      --ignore_eos --dtype bfloat16 --dataset "$EAGLE_JAX_MTBENCH" --out "$out/offline.json" 2>&1 \
      | grep -E "tok/s|tokens/s|Error" | tail -3
    closed_loops() {  # pass: the closed loop on each server kind (the first pass also 1 request/s, clocked)
      serve_once "process-$1"
      if [ $1 = 1 ]; then
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 100 \
          > "$out/gpu_clocks.csv" 2>/dev/null &
        local clocks=$!
        bench "eagle3 k=4, 16 slots, random weights, engine process" --request-rate 1 --num-prompts 16
        kill $clocks
      fi
      bench "eagle3 k=4, 16 slots, random weights, engine process" --concurrency 32 --num-prompts 256
      kill -TERM $server; wait $server
      serve_once "in-process-$1" --engine-in-process
      bench "eagle3 k=4, 16 slots, random weights, engine in the HTTP process" --concurrency 32 --num-prompts 256
      kill -TERM $server; wait $server
    }
    # What the goals need first, should the machine's time run out: one pass, then the steps, then the second pass.
    closed_loops 1
    shipped_steps
    closed_loops 2 ;;
  shipped) shipped_steps ;;
  draft)
    timeout 480 python3 benchmarks/kernels_bench.py --ops draft_lm_head,draft_lm_head_int8,draft_qkv,draft_gate_up,draft_down_parts \
      --rows 1 --block-n 16,32,64,128 --block-k 64,128,256 --evict-mb 256 --check --iterations 50 --trace-calls 20 \
      --out "$out/kernels.json" 2>&1 | grep -v -i warn | tail -56 ;;
  persistent)
    # The defaults (each stage's own work items, one a program, loaded ahead) polling either way, with
    # every stage and with none (the barriers alone); then each stage left out in turn: its share.
    timeout 240 python3 benchmarks/persistent_bench.py --random-target "$config" --rows auto --part-slots 256 \
      --num-warps 4 --spin volatile,atomic --skip none,all --out "$out/persistent.json" 2>&1 | grep -v -i warn | tail -6
    timeout 240 python3 benchmarks/persistent_bench.py --random-target "$config" --rows auto --part-slots 256 \
      --num-warps 4 --skip qkv,attend,o,gate_up,down --out "$out/persistent.json" 2>&1 | grep -v -i warn | tail -7 ;;
  chain)
    # Chains of 100 dependent kernels, each its own weights: the sum links (Pallas Triton, the same releasing
    # the next launch early, Mosaic GPU with and without programmatic dependent launch) and the 576 x 576
    # projection links (our fused Triton kernel at one row, a Mosaic GPU wgmma kernel with and without PDL);
    # then XLA's PDL flag off; then sum links of 4 KB a program (the latency floor).
    timeout 300 python3 benchmarks/pdl_chain_bench.py --kernels 100 --steps 32 --out "$out/pdl_chain.json" 2>&1 \
      | grep -v -i warn | tail -8
    XLA_FLAGS=--xla_gpu_enable_pdl=false timeout 150 python3 benchmarks/pdl_chain_bench.py --kernels 100 --steps 32 \
      --variants triton,triton_early,fused,mma_pdl --out "$out/pdl_chain.json" 2>&1 | grep -v -i warn | tail -5
    timeout 150 python3 benchmarks/pdl_chain_bench.py --kernels 100 --rows 8 --steps 32 --variants triton,mosaic,mosaic_pdl \
      --out "$out/pdl_chain.json" 2>&1 | grep -v -i warn | tail -4 ;;
  calls)
    timeout 120 python3 benchmarks/call_overhead.py --out "$out/call_overhead.json" 2>&1 | grep -v -i warn ;;
  barrier)
    # The grid barrier alone on grids up to the SMs, then the persistent kernel on a small config
    # (two layers, compiled in seconds at any grid) at 1, 2, 4, 8, 32 and 132 programs: which grid first
    # gives a wrong step, and whether the barrier alone already lets a wrong value through.
    timeout 200 python3 benchmarks/grid_barrier_bench.py --programs 1,2,8,32,132 --rounds 1000 --spin volatile,atomic \
      --out "$out/grid_barrier.json" 2>&1 | grep -v -i warn | tail -12
    python3 -c '
import json
config = json.load(open(".stage/smollm2_config.json"))
config.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=1024)
json.dump(config, open("/tmp/small_config.json", "w"))'
    timeout 300 python3 benchmarks/persistent_bench.py --random-target /tmp/small_config.json --cache-length 512 \
      --position 300 --programs 1,2,4,8,32,132 --part-slots 64 --num-warps 4 --prefetch 0,1 --steps 4 --repeats 1 \
      --out "$out/persistent.json" 2>&1 | grep -v -i warn | tail -12 ;;
  base)
    echo "== plain and EAGLE-3 k = 6, default flags (PTX dumped for the plain step)"
    rm -rf /tmp/dump_default
    XLA_FLAGS=--xla_dump_to=/tmp/dump_default prof "plain, default flags" --method none
    echo "ptx files: $(ls /tmp/dump_default/*.ptx 2>/dev/null | wc -l), with griddepcontrol: $(grep -l griddepcontrol /tmp/dump_default/*.ptx 2>/dev/null | wc -l)"
    prof "eagle3 k=6, default flags" --method eagle3 --k 6
    prof "eagle3 k=6, draft loop written out" --method eagle3 --k 6 --unroll-draft
    peer ;;
  peer) peer ;;
  pdl)
    echo "== XLA's programmatic dependent launch"
    rm -rf /tmp/dump_pdl
    XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_dump_to=/tmp/dump_pdl" prof "plain, --xla_gpu_enable_pdl=true" --method none
    echo "ptx files: $(ls /tmp/dump_pdl/*.ptx 2>/dev/null | wc -l), with griddepcontrol: $(grep -l griddepcontrol /tmp/dump_pdl/*.ptx 2>/dev/null | wc -l)"
    XLA_FLAGS=--xla_gpu_enable_pdl=true prof "eagle3 k=6, --xla_gpu_enable_pdl=true" --method eagle3 --k 6
    XLA_FLAGS=--xla_gpu_enable_pdl=false prof "plain, --xla_gpu_enable_pdl=false" --method none
    XLA_FLAGS=--xla_gpu_enable_pdl=true prof "eagle3 k=6, pdl, draft loop written out" --method eagle3 --k 6 --unroll-draft
    prof "plain, default flags, again" --method none ;;
  repeat)
    for pass in 1 2; do
      prof "plain, pass $pass" --method none --trace-steps 128
      prof "eagle3 k=6, pass $pass" --method eagle3 --k 6 --trace-steps 128
      prof "eagle3 k=6, draft loop written out, pass $pass" --method eagle3 --k 6 --unroll-draft --trace-steps 128
    done ;;
  cache)
    prof "plain, cache 512" --method none --cache-length 512
    prof "plain, cache 1024" --method none --cache-length 1024
    prof "eagle3 k=6, cache 1024" --method eagle3 --k 6 --cache-length 1024
    prof "plain, cache 1024, XLA kernels" --method none --cache-length 1024 --decode-kernels xla
    prof "eagle3 k=6, cache 1024, XLA kernels" --method eagle3 --k 6 --cache-length 1024 --decode-kernels xla ;;
  ab)
    overlay() {  # DIR FILES: this tree's eagle_jax with FILES' files (at their paths) over it, in DIR
      rm -rf "$1" && mkdir -p "$1" && cp -r eagle_jax "$1/" && cp -r "$2/." "$1/"
    }
    base=/tmp/kernel_base_tree
    overlay $base .stage/kernel_base
    for pass in $(seq 1 ${AB_PASSES:-2}); do
      prof "plain, this tree, pass $pass" --method none --cache-length 2048
      PYTHONPATH=/tmp/site:$base prof "plain, kernel base, pass $pass" --method none --cache-length 2048
    done
    prof "eagle3 k=6, this tree" --method eagle3 --k 6 --cache-length 2048
    PYTHONPATH=/tmp/site:$base prof "eagle3 k=6, kernel base" --method eagle3 --k 6 --cache-length 2048
    if [ -d .stage/kernel_variant ]; then  # a second change's files over this tree, beside the first
      variant=/tmp/kernel_variant_tree
      overlay $variant .stage/kernel_variant
      PYTHONPATH=/tmp/site:$variant prof "eagle3 k=6, kernel variant" --method eagle3 --k 6 --cache-length 2048
    fi ;;
esac
echo "$phase DONE"
