#!/usr/bin/env bash
# Self-distils ShareGPT prompts with the target, trains the EAGLE-1 and EAGLE-3 heads, and evaluates
# them on MT-Bench (held out). Run from the repo root after `source tools/gpu/setup.sh`:
#   bash tools/gpu/train_heads.sh RUN_DIR [NUM_PROMPTS] [EAGLE_STEPS] [EAGLE3_STEPS]
set -ex
run=${1:?run directory}; prompts=${2:-20000}; eagle_steps=${3:-2000}; eagle3_steps=${4:-2000}
mkdir -p "$run"
if [ ! -f "$run/distill.npz" ]; then
  python3 -m eagle_jax.train.distill --prompts .stage/distill_prompts.npz --limit "$prompts" --out "$run/distill.npz" \
    --max-prompt-tokens 256 --max-new-tokens 256 --batch-size 256 --dtype bfloat16
fi
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
python3 -m eagle_jax.train --method eagle --data "$run/distill.npz" --output "$run/eagle" --steps "$eagle_steps" \
  --batch-size 32 --eval-prompts 80 --eval-k 5
python3 -m eagle_jax.train --method eagle3 --data "$run/distill.npz" --output "$run/eagle3" --steps "$eagle3_steps" \
  --batch-size 32 --eval-prompts 80 --eval-k 5
