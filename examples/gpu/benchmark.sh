#!/usr/bin/env bash
# The issue-5 benchmark queue on one H200, most needed first; each script appends its rows to
# $RESULTS/*.json as it finishes a setting, so a run cut short keeps what it measured.
# From the repo root, after `source examples/gpu/setup.sh`:  bash examples/gpu/benchmark.sh
# The k = 1..7 EAGLE-3 sweep and EAGLE-1 k = 1, 2 ran on 2026-11-30 (docs/BENCHMARKS.md).
set -x
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
r=${RESULTS:-docs/results}; mkdir -p $r
m="--num_prompts 80 --max_new_tokens 256 --out $r/mtbench.json"
# Plain decoding beside HF transformers on the same GPU (the 20x goal needs them in one run).
python3 examples/eagle.py --method none --max_num_seqs 1 $m
python3 examples/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 3 --max_new_tokens 128 --dtype bfloat16 --out $r/mtbench.json
# Per-step loop overhead: the exit test every step vs every 8 steps, plain and EAGLE-3 k = 5.
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --steps_per_check 8 $m
python3 examples/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 1 $m
python3 examples/eagle.py --method eagle --num_spec_tokens 3,4,5,6,7 --max_num_seqs 1 $m
python3 examples/profile_step.py --method eagle3 --k 5 --iterations 50 --out $r/profile.json
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 1 --max_new_tokens 32 --eager --out $r/mtbench.json
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 1 --max_new_tokens 32 --out $r/mtbench.json
# Issue 11: static batches vs decode slots refilled as rows finish; EAGLE-3's best k at batch 16 and
# 64 (for defaults.json's per-batch-size entries); speculation paused while more than 16 rows run.
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 4,16,64 --scheduler static,continuous $m
python3 examples/eagle.py --method eagle3 --num_spec_tokens 1,2,3 --max_num_seqs 16,64 --scheduler continuous $m
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 64 --scheduler continuous --speculative_disable_by_batch_size 16 $m
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --temperature 1.0 $m
