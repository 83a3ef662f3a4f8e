#!/usr/bin/env bash
# The benchmark queue on one H200 with the shipped heads, most needed first; each script appends
# its rows to $RESULTS/*.json as it finishes a setting, so a run cut short keeps what it measured.
# From the repo root, after `source examples/gpu/setup.sh`:  bash examples/gpu/benchmark.sh
# (heads_pipeline.sh runs it on the second GPU while the first trains a single head).
set -x
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
r=${RESULTS:-docs/results}; mkdir -p $r
m="--num_prompts 80 --max_new_tokens 256 --out $r/mtbench.json"
# Issue 11: static batches vs decode slots refilled as rows finish, plain and EAGLE-3.
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 4,16,64 --scheduler static,continuous $m
# Issue 12: EAGLE-2 trees with the shipped EAGLE-3 head beside its chain (k = 5, the default).
python3 examples/eagle.py --method eagle3 --num_spec_tokens 5 --speculative_eagle_topk 2,4,8 --speculative_num_steps 5 \
  --speculative_num_draft_tokens 8,16,32,64 --max_num_seqs 1 $m
# Issue 11: EAGLE-3's best k at batch 16 and 64 (defaults.json's per-batch-size entries), and
# speculation paused while more than 16 rows run.
python3 examples/eagle.py --method eagle3 --num_spec_tokens 1,2,3 --max_num_seqs 16,64 --scheduler continuous $m
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 64 --scheduler continuous --speculative_disable_by_batch_size 16 $m
# Issue 10's leftovers: plain decoding beside HF transformers on the same GPU, the exit test every
# 8 steps, eager vs compiled acceptance (2 prompts x 32 tokens), temperature 1.0, cold vs warm.
python3 examples/eagle.py --method none --max_num_seqs 1 $m
python3 examples/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 3 --max_new_tokens 128 --dtype bfloat16 --out $r/mtbench.json
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --steps_per_check 8 $m
for mode in --eager ""; do
  python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 2 --max_new_tokens 32 $mode --out $r/mtbench.json
done
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --temperature 1.0 $m
python3 examples/profile_step.py --parts cold_warm --out $r/profile.json
# Issue 10: XLA flags against the M = 1 matmul lowering, plain step at batch 1 (step_trace rows).
for flags in "--xla_gpu_enable_triton_gemm=false" "--xla_gpu_enable_cublaslt=true" \
             "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true"; do
  XLA_FLAGS="$flags" python3 examples/profile_step.py --parts step_trace --method none --cache-length 1024 \
    --label "XLA_FLAGS=$flags" --out $r/profile.json
done
