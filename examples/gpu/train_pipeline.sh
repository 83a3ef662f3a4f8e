#!/usr/bin/env bash
# One lease's head-training pipeline: multi-turn self-distillation, training, evaluation. Every
# stage writes as it goes and a rerun resumes (distilled parts and orbax checkpoints are reused).
# From the repo root, after `source examples/gpu/setup.sh`, with .stage/turns.npz and
# .stage/heldout.jsonl from `examples/prepare_data.py --distill-turns-out ... --held-out-out ...`:
#   RESULTS=DIR bash examples/gpu/train_pipeline.sh RUN_DIR [METHOD] [STEPS]
# Time budgets (seconds): DISTILL_SECONDS (no new part starts after it), TRAIN_SECONDS.
set -x
run=${1:?run directory}; method=${2:-eagle3}; steps=${3:-2600}
r=${RESULTS:-docs/results}; mkdir -p "$run" "$r"
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
python3 -m eagle_jax.distill --turns .stage/turns.npz --out "$run/distill" --rounds 3 --temperatures 0,0.8,1.0,0.7,0.9 \
  --max-prompt-tokens 384 --max-new-tokens 256 --batch-size 1024 --max-seconds "${DISTILL_SECONDS:-420}"
python3 -m eagle_jax.train --method "$method" --data "$run/distill" --output "$run/$method" --steps "$steps" \
  --batch-size 64 --warmup-steps 100 --max-seconds "${TRAIN_SECONDS:-480}" --eval-prompts 0
cp "$run/$method/metrics.json" "$r/${method}_metrics.json"
m="--method $method --draft $run/$method/head --max_num_seqs 1 --num_prompts 80 --max_new_tokens 256"
python3 examples/eagle.py $m --num_spec_tokens 5 --dataset .stage/heldout.jsonl --out "$r/heldout.json"
python3 examples/eagle.py $m --num_spec_tokens 5,1,3,7,2,4,6 --out "$r/mtbench.json"
