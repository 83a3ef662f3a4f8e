#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs, from the repo root after `source tools/gpu/setup.sh`:
#   bash tools/gpu/tensor_parallel.sh [SECTION ...]   (links oneshot identity steps mtbench; default all)
# 1. SmolLM2-135M greedy outputs at tensor parallel size 2 equal size 1 (float32; plain and EAGLE-3
#    k = 5; 3 kv heads: attention replicated, MLP and vocabulary split). Prints IDENTICAL or DIFFER.
# 2. Llama-3.1-8B-shaped plain and draft steps (random bf16 weights) at sizes 1 and 2, the heads
#    whole on each GPU and then split (--split_heads: their MLPs and draft vocabulary), to measure
#    whether a head should be replicated or split.
# 3. SmolLM2 MT-Bench throughput at sizes 1 and 2 (a 135M model is too small to gain from a split),
#    EAGLE-3's head whole and split.
# oneshot: XLA's one-shot all-reduce kernel (each GPU reads its peers' buffers over NVLink in one
# kernel, no NCCL launch) for the small all-reduces of a batch-1 step, which NCCL ran at ~26 µs
# each on two H200s on 2026-11-30 (commit 3134358, benchmarks/allreduce_latency.py --chain loop):
# the latency probe and the 8B-shaped TP 2 steps with it (rows carry xla_flags).
set -ex
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
r=${RESULTS:-docs/results}; mkdir -p $r
head -n 20 $EAGLE_JAX_MTBENCH > /tmp/tp_prompts.jsonl
links() {  # how the GPUs are linked and what one small all-reduce costs (unrolled and in a loop)
  nvidia-smi topo -m > $r/topology.txt 2>&1 || true
  NCCL_DEBUG=INFO python3 benchmarks/allreduce_latency.py --out $r/profile.json 2>&1 \
    | grep -i "allreduce_latency\|via\|transport\|NCCL version" | head -40 > $r/allreduce_latency.txt || true
  cat $r/topology.txt $r/allreduce_latency.txt
}
oneshot() {
  local flags=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
  XLA_FLAGS=$flags python3 benchmarks/allreduce_latency.py --out $r/profile.json 2>&1 | grep allreduce_latency || true
  XLA_FLAGS=$flags python3 benchmarks/scale_8b.py --ks 5 --iterations 20 --tensor_parallel_size 2 --steps_per_call 16 --out $r/profile.json
}
identity() {  # SmolLM2 greedy outputs at TP 2 equal TP 1 (EAGLE-3 with its head whole, then split at TP 2)
  for setting in plain eagle3 eagle3-split-head; do
    drafting="--method eagle3 --num-speculative-tokens 5"; split=""
    case $setting in
      plain) drafting="--draft none" ;;
      eagle3-split-head) split="--draft-tensor-parallel-size 2" ;;
    esac
    for size in 1 2; do
      # Full float32 matmuls (not TF32): 17/20 prompts matched on 2026-11-30 with the default precision.
      # XLA's kernels at both sizes: "auto" picks the Pallas ones on one GPU only, and their sums
      # round otherwise than XLA's, which would make TP 1 and 2 differ for a reason other than TP.
      JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m eagle_jax.generate --prompts-file /tmp/tp_prompts.jsonl --json \
        --dtype float32 --max-new-tokens 128 --ignore-eos $drafting --tensor-parallel-size $size --decode-kernels xla \
        $([ $size = 2 ] && echo $split) > /tmp/tp$size.jsonl
    done
    python3 -c "
import json
rows = [[json.loads(line)['token_ids'] for line in open(f'/tmp/tp{size}.jsonl')] for size in (1, 2)]
same = sum(a == b for a, b in zip(*rows))
print('$setting:', 'IDENTICAL' if same == len(rows[0]) == len(rows[1]) else 'DIFFER', f'{same}/{len(rows[0])} prompts')" \
      | tee -a $r/tp_identity.txt  # results/ comes back with every poll; the console may not
  done
}
steps() {  # the 8B-shaped steps: 16 steps a call in one program (as the Engine's device loop runs
  # them), then one step a call (each call's launch on two GPUs counts)
  python3 benchmarks/scale_8b.py --ks 5 --iterations 20 --tensor_parallel_size 1,2 --steps_per_call 16 --out $r/profile.json
  python3 benchmarks/scale_8b.py --ks 1,3,5 --iterations 20 --tensor_parallel_size 1,2 --out $r/profile.json
  # the heads split too (MLPs, draft vocabulary): draft steps against the whole heads' above
  python3 benchmarks/scale_8b.py --ks 5 --iterations 20 --tensor_parallel_size 2 --steps_per_call 16 --split_heads \
    --out $r/profile.json
}
mtbench() {  # SmolLM2 throughput at both sizes
  python3 benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --tensor_parallel_size 1,2 \
    --num_prompts 20 --max_new_tokens 256 --out $r/mtbench.json
  python3 benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 1 --tensor_parallel_size 2 \
    --split_draft_head --num_prompts 20 --max_new_tokens 256 --out $r/mtbench.json
}
for section in ${@:-links oneshot identity steps mtbench}; do
  $section
done
