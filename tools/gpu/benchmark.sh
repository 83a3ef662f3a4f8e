#!/usr/bin/env bash
# The benchmark queue on one H200 with the shipped heads. Each script appends its rows to
# $RESULTS/*.json as it finishes a setting, so a run cut short keeps what it measured.
# From the repo root, after `source tools/gpu/setup.sh`:
#   bash tools/gpu/benchmark.sh [SECTION ...]      (default: every section, in this order)
# Sections needing no model files (random weights): kernels, step_kernels, tree_ops, l2_probe, attention_fill, attention_split, xla_flags.
# (heads_pipeline.sh runs the whole queue on the second GPU while the first trains one head.)
# DRAFT=DIR runs the EAGLE-3 rows with that head instead of the shipped one (e.g. a head trained in
# the same lease, so that its trees and sampling rows are measured before it ships), if it exists.
set -x
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
r=${RESULTS:-docs/results}; mkdir -p $r
d=""; [ -d "${DRAFT:-}" ] && d="--draft $DRAFT"  # a head that failed to train leaves the shipped one
m="--num_prompts 80 --max_new_tokens 256 --out $r/mtbench.json $d"
config=${RANDOM_TARGET_CONFIG:-.stage/tokenizer/config.json}  # SmolLM2's config.json, for random weights

batching() {  # issue 11: static batches vs decode slots refilled as rows finish
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 16,64 --scheduler static,continuous $m
}
batch_kernels() {  # issues 10-11: at 16 and 64 rows the Pallas attention kernel reads each row's
  # filled slots only (XLA's reads the whole attend length, which a continuous batch keeps long)
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 16,64 --scheduler static,continuous \
    --decode_kernels pallas $m
}
batch_eagle() {  # issue 11: EAGLE-3 at 16 and 64 rows on both decode kernels, beside batch_kernels' plain rows
  # (its EAGLE-3 rows, cut off in lease 11), and speculation paused above 16 rows at 64
  for kernels in pallas xla; do
    python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 16,64 --scheduler static,continuous \
      --decode_kernels $kernels $m
  done
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 64 --scheduler static,continuous \
    --speculative_disable_by_batch_size 16 --decode_kernels pallas $m
}
batch_steps() {  # issue 11: continuous batching lost 0.4 s to static at 16 rows (lease 13): 0.17 s in refills
  # that wrote the whole cache and 0.17 s of host time. After the fix (a refill writes the prefilled slots only,
  # the idle state is built on the device): plain and EAGLE-3 at 16 and 64 rows, both schedulers; refill at 16
  python3 benchmarks/eagle.py --method none --max_num_seqs 16,64 --scheduler static,continuous --decode_kernels pallas $m
  python3 benchmarks/eagle.py --method none --max_num_seqs 16 --scheduler continuous --refill_at 16 --decode_kernels pallas $m
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 16,64 --scheduler static,continuous \
    --decode_kernels pallas $m
}
while_graphs() {  # issues 10, 11: XLA:GPU runs a data-dependent while_loop from the host, one round trip a step
  # (the run calls return only when their loop ends: lease 12's counters); "+WHILE" records the loop into the
  # command buffer as a CUDA graph conditional node, so the device runs the steps back to back
  f="--xla_gpu_enable_command_buffer=+WHILE"
  XLA_FLAGS="$f" python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 $m
  XLA_FLAGS="$f" python3 benchmarks/eagle.py --method none --max_num_seqs 16 --scheduler static,continuous \
    --decode_kernels pallas $m
}
batch_trace() {  # issue 11: why continuous batching loses to static at 16 rows (0.73x, lease 11): a traced
  # second run of each says how much of the wall time the device was busy, and in which program
  python3 benchmarks/eagle.py --method none --max_num_seqs 16 --scheduler static,continuous --decode_kernels pallas \
    --trace $m
}
trees() {  # issue 12: EAGLE-2 trees with the shipped EAGLE-3 head beside its chain (k = 5 and the default 6)
  # and plain decoding
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5,6 --max_num_seqs 1 $m
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --speculative_eagle_topk 4,8 --speculative_num_steps 5 \
    --speculative_num_draft_tokens 16,32,64 --max_num_seqs 1 $m
  tree_steps
}
tree_steps() {  # issue 12: where a tree step's time goes (the shipped head; the chain's trace is step_kernels')
  for tree in 4,5,16 8,5,64; do
    python3 benchmarks/profile_step.py --parts step_trace --method eagle3 --tree $tree --cache-length 1024 \
      --label "tree $tree" --out $r/profile.json
  done
}
tree_heads() {  # issue 12: the shipped head's two best-known trees and their neighbours (top-4 and top-8 x 16
  # and 64 nodes, depth 5), a short form of `trees` for a lease that also trains a head
  python3 benchmarks/eagle.py --method eagle3 --speculative_eagle_topk 4,8 --speculative_num_steps 5 \
    --speculative_num_draft_tokens 16,64 --max_num_seqs 1 $m
}
tree_ops() {  # issue 12: a tree step's own ops alone (random data): the expansion's top-k, one call
  # against two stages; the accepted path's move into place, a gather and write per buffer against one kernel
  python3 benchmarks/kernels_bench.py --rows 4,8 --ops draft_top_k --out $r/kernels.json
  python3 benchmarks/kernels_bench.py --rows 6 --ops compact_cache --out $r/kernels.json
}
tree_kernels() {  # issues 10, 12: the best tree (4/5/16: a 17-row verify) with the fused linear kernels around
  # XLA's attention (a tree's attention is XLA's under either Pallas setting) and the one-kernel compaction
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --speculative_eagle_topk 4 --speculative_num_steps 5 \
    --speculative_num_draft_tokens 16 --max_num_seqs 1 --decode_kernels pallas_linear $m
  python3 benchmarks/profile_step.py --parts step_trace --method eagle3 --tree 4,5,16 --cache-length 1024 \
    --decode-kernels pallas_linear --label "tree 4,5,16 pallas_linear" --out $r/profile.json
}
batch_k() {  # issue 11: EAGLE-3's best k at batch 16 and 64; speculation paused above 16 rows
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 1,2,3 --max_num_seqs 16,64 --scheduler continuous $m
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 64 --scheduler continuous \
    --speculative_disable_by_batch_size 16 $m
}
kernels() {  # issue 10: fused Pallas decode kernels vs XLA, alone and in the traced step (random weights)
  python3 benchmarks/kernels_bench.py --rows 1,4,8 --out $r/kernels.json
  step_kernels xla pallas
  python3 benchmarks/kernels_bench.py --rows 1 --ops norm_linear,norm_gate_up,down_proj_residual \
    --block-n 16,32,64 --block-k 128,256 --num-warps 4 --num-stages 3 --out $r/kernels.json
  python3 benchmarks/kernels_bench.py --rows 1,4 --ops decode_attention --block-s 32,64,128 --num-warps 2,4 \
    --num-stages 2,3 --out $r/kernels.json
}
step_kernels() {  # issue 10: the traced plain and EAGLE-3 k = 5 steps with each of the given decode kernels
  # (default: every Pallas setting; random weights)
  for method in "none" "eagle3 --k 5"; do
    for kernels in ${@:-pallas pallas_linear}; do
      python3 benchmarks/profile_step.py --parts step_trace --random-target $config --method $method --cache-length 1024 \
        --decode-kernels $kernels --label "decode kernels $kernels" --out $r/profile.json
    done
  done
}
l2_probe() {  # issue 10: the kernels alone with and without 256 MB read between calls (a real step's other
  # layers pass through L2 between two calls of a layer): do they cost more once their inputs come from HBM?
  python3 benchmarks/kernels_bench.py --rows 1 --ops decode_attention,norm_gate_up,down_proj_residual --tokens 1,6 \
    --evict-mb 0,256 --out $r/kernels.json
}
attention_fill() {  # issue 10: the attention kernel alone over the step trace's fill (64 filled slots of 128,
  # a cold L2 too): in the traced step the 6-token verify costs 26.6 µs a layer, alone over 512 filled 13.8
  python3 benchmarks/kernels_bench.py --rows 1 --ops decode_attention --tokens 1,6 --cache-length 128 \
    --evict-mb 0,256 --label "step fill" --out $r/kernels.json
}
attention_split() {  # issue 10: the attention kernel split over the cache (Tiling.splits), at a decode
  # step (1 token a row) and a k = 5 chain's verify (6 tokens), at the default tiling
  python3 benchmarks/kernels_bench.py --rows 1,4 --ops decode_attention --tokens 1,6 --splits 1,2,4,8 \
    --out $r/kernels.json
}
real_kernels() {  # issue 10: the fused kernels end to end on MT-Bench (real weights), with and without the
  # attention kernel (pallas_linear: XLA attends between the fused linears)
  for kernels in pallas pallas_linear; do
    python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --decode_kernels $kernels $m
  done
}
xla_flags() {  # issue 10: XLA flags against the M = 1 matmul lowering (plain step, random weights)
  for flags in "--xla_gpu_enable_triton_gemm=false" "--xla_gpu_enable_cublaslt=true"; do
    XLA_FLAGS="$flags" python3 benchmarks/profile_step.py --parts step_trace --random-target $config --method none \
      --cache-length 1024 --label "XLA_FLAGS=$flags" --out $r/profile.json
  done
}
peers() {  # HF transformers on the same GPU; the exit test every 8 steps; eager vs compiled acceptance
  python3 benchmarks/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 3 --max_new_tokens 128 --dtype bfloat16 --out $r/mtbench.json
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --steps_per_check 8 $m
  eager_check
}
eager_check() {  # the seed's own check: eager and compiled acceptance within 0.01 (2 prompts x 32 tokens), in
  # float32: in bf16 op-by-op rounding alone changes greedy tokens, so the two would score different texts.
  # At float32 matmul precision: XLA:GPU's default lets the compiled program's float32 dots round their
  # inputs (lease 12: compiled 2.423 at the default, 2.207 at "highest", the same as the eager run's 2.207)
  for mode in --eager ""; do
    JAX_DEFAULT_MATMUL_PRECISION=highest python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 2 --max_new_tokens 32 $mode \
      --dtype float32 --out $r/mtbench.json $d
  done
}
sampling() {  # temperature 1.0; cold vs warm start
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --temperature 1.0 $m
  python3 benchmarks/profile_step.py --parts cold_warm --out $r/profile.json $d
}

for section in ${@:-batching batch_kernels batch_eagle batch_steps while_graphs batch_trace trees tree_heads tree_ops tree_kernels batch_k kernels l2_probe attention_fill attention_split real_kernels xla_flags peers sampling}; do
  $section
done
