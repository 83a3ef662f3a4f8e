#!/usr/bin/env bash
# Plain decoding on this CPU, eagle_jax vs HF transformers (torch), same weights, one run, and
# the fraction of the copy bandwidth that eagle_jax's decode step reaches (benchmarks/cpu_roofline.py).
# From the repo root:  bash benchmarks/cpu_vs_hf.sh [NUM_PROMPTS] [MAX_NEW_TOKENS]
set -ex
n=${1:-5}; tokens=${2:-64}; out=docs/results/cpu.json
python benchmarks/eagle.py --method none --dtype float32 --num_prompts "$n" --max_new_tokens "$tokens" --out $out
python benchmarks/hf_peers.py --modes eager,static --dtype float32 --num_prompts "$n" --max_new_tokens "$tokens" --device cpu --out $out
python benchmarks/cpu_roofline.py --dtype float32 --out $out
