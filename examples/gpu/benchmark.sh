#!/usr/bin/env bash
# The issue-5 benchmark run on one H200, in priority order; each script appends its rows to
# docs/results/*.json as it finishes a setting, so a run cut short keeps what it measured.
# From the repo root, after `source examples/gpu/setup.sh`:  bash examples/gpu/benchmark.sh
set -x
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
ks=1,2,3,4,5,6,7
r=${RESULTS:-docs/results}; mkdir -p $r
python3 examples/eagle.py --method none,eagle3,eagle --num_spec_tokens $ks --max_num_seqs 1 --num_prompts 80 --max_new_tokens 256 --out $r/mtbench.json
python3 examples/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 3 --max_new_tokens 128 --dtype bfloat16 --out $r/mtbench.json
python3 examples/profile_step.py --method eagle3 --k 3 --iterations 50 --out $r/profile.json
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 1 --max_new_tokens 32 --eager --out $r/mtbench.json
python3 examples/eagle.py --method eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 1 --max_new_tokens 32 --out $r/mtbench.json
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 3 --max_num_seqs 4,16,64 --num_prompts 80 --max_new_tokens 256 --out $r/mtbench.json
python3 examples/eagle.py --method none,eagle3 --num_spec_tokens 3 --max_num_seqs 1 --num_prompts 80 --max_new_tokens 256 --temperature 1.0 --out $r/mtbench.json
