#!/usr/bin/env bash
# The head pipeline over every GPU of the machine (one or two): profile the train step, distil,
# train EAGLE-3 (and EAGLE-1 on a second GPU), evaluate. Stages write as they go; a rerun reuses
# distilled parts and resumes training from its orbax checkpoint.
# From the repo root, after `source tools/gpu/setup.sh`, with .stage/turns.npz,
# .stage/heldout.jsonl and .stage/mtbench_question.jsonl:
#   RESULTS=DIR bash tools/gpu/heads_pipeline.sh RUN_DIR
# Budgets (seconds): DISTILL_SECONDS (no new part starts after it), TRAIN_SECONDS (the step
# count is set from the profiled step time so that the cosine schedule ends inside it).
# SKIP_DISTILL=1 trains on the parts already in RUN_DIR/distill (carried from an earlier machine);
# INIT_FROM_SHIPPED=1 starts each head from the shipped one (eagle_jax/heads/) instead of random;
# TRAIN_TOKENS=N trains on a nested random subset of N generated tokens (data-scaling points).
# TRAIN_PARTS="GLOB ..." trains on the parts of RUN_DIR/distill that match (e.g. "round* extra-round0-t0.npz"):
# distilled and carried parts that match none are kept, not trained on.
# LEARNING_RATE sets the peak rate (default eagle-jax-train's 5e-4), e.g. lower to continue a head.
# BATCH_SIZE: sequences a step (default 64), the step count scaled down to fit the same time.
# DRAFT_VOCAB_SIZE (EAGLE-3): with INIT_FROM_SHIPPED, a larger one extends the shipped head's vocabulary.
# HEAD_INTERMEDIATE_SIZE: the head's MLP width; with INIT_FROM_SHIPPED, a larger one widens the shipped head.
# HEAD_LAYERS (EAGLE-3): the head's decoder layers; with INIT_FROM_SHIPPED, more than the shipped head's
# adds layers that start as the identity (`head_growth.add_layers`).
# PROFILE_FROM=FILE skips the profiling and sizes training from the fastest train_trace row of
# each method in FILE (e.g. docs/results/profile_h200.json: a step costs the same on every H200).
# STEP_MS overrides that step time (ms at batch 64), e.g. a wider head's, from the steps and
# seconds in an earlier metrics.json of it (3,462 steps in 421 s: 122 ms).
# HEADS=eagle3 trains EAGLE-3 alone (on GPU 0); a second GPU then runs benchmarks/gpu_benchmark.sh
# with the shipped heads (the sections in BENCH_SECTIONS, default its own; "none" runs none), its rows in RESULTS/gpu1/.
# Two heads with SKIP_DISTILL: GPU 1 runs BENCH_SECTIONS (default none) after EAGLE-1's evaluation.
# DRAFT=DIR (an existing head directory) benchmarks that EAGLE-3 head in place of the shipped one.
# SCALING_TOKENS="N1 N2 ..." (with HEADS=eagle3): GPU 1 first (one GPU: last) trains EAGLE-3 from
# scratch on nested subsets of N tokens of the carried data, SCALING_SECONDS each (equal steps),
# and evaluates each at k = 5 on MT-Bench (rows in RESULTS/scaling.json): the data-scaling curve.
# EXTEND_UNTRAINED="N1 N2 ..." (HEADS=eagle3): before training, the shipped EAGLE-3 head extended to an
# N-token draft vocabulary with no training (`draft_vocabulary.extend_draft_vocabulary`'s placed columns,
# eagle-jax-train --steps 0) is evaluated at k = 5 and 6 on MT-Bench (rows in RESULTS/mtbench_eagle3-vocabN.json).
# On one GPU, HEADS=eagle3 runs the head, then BENCH_SECTIONS (else the step traces), then the scaling points.
# GPU1_VARIANT="NAME=VALUE ..." (HEADS=eagle3 on two GPUs, in place of the scaling points): GPU 1 trains a
# second EAGLE-3 head with these settings changed (e.g. "DRAFT_VOCAB_SIZE=16384"), into
# RUN_DIR/eagle3-variant, evaluated as the first (rows in RESULTS/*_eagle3-variant.json): two settings at once.
# A staged .stage/extra_turns.npz (prompt sources beyond ShareGPT, docs/training.md) is distilled
# too, at EXTRA_TEMPERATURES (default 0,0.8), into parts named extra-*.
# Parts carried from earlier machines (stage_local.sh carry; setup.sh unpacks them into RUN_DIR/distill)
# are reused where their names match and trained on with the new ones: a new DISTILL_SEED adds fresh
# sampled parts beside them, and the greedy parts are not distilled again.
# One GPU: DISTILL_ROUNDS (default 3) and DISTILL_TEMPERATURES (default 0,0.8,1.0,0.7) set the ShareGPT
# distillation; DISTILL_SEED (default 0) samples every distillation's answers anew (parts named -s<seed>),
# e.g. to train a shipped head on fresh answers to the prompts it has seen.
set -x
run=${1:?run directory}; r=${RESULTS:-docs/results}; mkdir -p "$run" "$r"
export EAGLE_JAX_MTBENCH=.stage/mtbench_question.jsonl
gpus=$(nvidia-smi -L | wc -l)
train_seconds=${TRAIN_SECONDS:-540}

distill() {  # distill GPU OUT_DIR ARGS...: greedy rounds need --rounds 3 --temperatures 0,...
  CUDA_VISIBLE_DEVICES=$1 python3 -m eagle_jax.cli.distill --turns .stage/turns.npz --out "$2" --max-prompt-tokens 384 \
    --max-new-tokens 256 --batch-size 1024 --max-seconds "${DISTILL_SECONDS:-240}" --seed "${DISTILL_SEED:-0}" "${@:3}"
}
profile() {  # profile GPU METHOD ATTENTION [UNROLL]: one train_trace row in $r/profile.json
  [ -n "$PROFILE_FROM" ] && return 0
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/profile_train.py --method "$2" --attention "$3" ${4:+--unroll $4} \
    --batch-size 64 --sequence-length 640 --timed-steps 10 --steps 3 --label "heads_pipeline" --out "$r/profile.json"
}
fastest() {  # fastest METHOD: "attention step_ms" of the quickest profiled train step of METHOD
  python3 - "${PROFILE_FROM:-$r/profile.json}" "$1" "$PROFILE_FROM" <<'EOF'
import json, sys
# A profile made by this pipeline has the label heads_pipeline; a carried file's rows all count.
rows = [row for row in json.load(open(sys.argv[1])) if row.get("kind") == "train_trace" and row["method"] == sys.argv[2]
        and (sys.argv[3] or row.get("label") == "heads_pipeline")]
best = min(rows, key=lambda row: row["step_ms"])
print(best.get("attention", "xla"), best["step_ms"])
EOF
}
sized() {  # sized METHOD SECONDS: "attention steps", the steps that fit SECONDS at the profiled step time
  # (profiled at batch 64: a BATCH_SIZE step is taken to cost BATCH_SIZE / 64 of one)
  read -r attention step_ms <<< "$(fastest "$1")"
  step_ms=${STEP_MS:-$step_ms}
  echo "$attention $(python3 -c "print(int($2 * 1000 / ($step_ms * ${BATCH_SIZE:-64} / 64) * 0.92))")"
}
train_data() {  # train_data NAME: the parts NAME trains on: $run/distill, or with TRAIN_PARTS="GLOB ..." links
  # to the matching parts in $run/train-parts-NAME (its own: two heads may train at once)
  [ -n "$TRAIN_PARTS" ] || { echo "$run/distill"; return; }
  rm -rf "$run/train-parts-$1" && mkdir -p "$run/train-parts-$1"
  (cd "$run/distill" && for glob in $TRAIN_PARTS; do for part in $glob; do [ -f "$part" ] && ln -f "$part" "../train-parts-$1/"; done; done)
  echo "$run/train-parts-$1"
}
train() {  # train GPU METHOD UNROLL [NAME]: steps sized to $train_seconds from the profiled step time,
  # into $run/NAME (default METHOD)
  local name=${4:-$2}
  read -r attention steps <<< "$(sized "$2" "$train_seconds")"
  init=""; [ -n "$INIT_FROM_SHIPPED" ] && init="--init-head eagle_jax/heads/smollm2-135m-instruct-$2"
  depth=""; [ "$2" = eagle3 ] && [ -n "$HEAD_LAYERS" ] && depth="--head-layers $HEAD_LAYERS"
  CUDA_VISIBLE_DEVICES=$1 python3 -m eagle_jax.train --method "$2" --unroll "$3" --attention "$attention" $init \
    ${TRAIN_TOKENS:+--train-tokens $TRAIN_TOKENS} ${LEARNING_RATE:+--learning-rate $LEARNING_RATE} \
    ${DRAFT_VOCAB_SIZE:+--draft-vocab-size $DRAFT_VOCAB_SIZE} ${HEAD_INTERMEDIATE_SIZE:+--head-intermediate-size $HEAD_INTERMEDIATE_SIZE} \
    $depth \
    --data "$(train_data "$name")" --output "$run/$name" --steps "$steps" --batch-size "${BATCH_SIZE:-64}" --warmup-steps 200 \
    --max-seconds "$train_seconds" --eval-prompts 0 && cp "$run/$name/metrics.json" "$r/${name}_metrics.json"
}
evaluate() {  # evaluate GPU METHOD [NAME]: $run/NAME's head on held-out ShareGPT at k = 5, MT-Bench at k = 1..7
  local name=${3:-$2}
  m="--method $2 --draft $run/$name/head --max_num_seqs 1 --num_prompts 80 --max_new_tokens 256"
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/eagle.py $m --num_spec_tokens 5 --dataset .stage/heldout.jsonl \
    --out "$r/heldout_$name.json"
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/eagle.py $m --num_spec_tokens 5,1,3,7,2,4,6 --out "$r/mtbench_$name.json"
}
variant() {  # variant GPU: EAGLE-3 again with GPU1_VARIANT's settings ("NAME=VALUE ..."), into $run/eagle3-variant
  ( export $GPU1_VARIANT; train "$1" eagle3 7 eagle3-variant; evaluate "$1" eagle3 eagle3-variant )
}
trace_steps() {  # trace_steps GPU: step_trace rows (plain and EAGLE-3 k = 5 at batch 1, the distil step)
  t="CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/profile_step.py --parts step_trace --out $r/profile.json"
  eval "$t --method none --cache-length 1024 --label baseline"
  eval "$t --method eagle3 --k 5 --cache-length 1024 --label baseline"
  eval "$t --method none --batch-size 1024 --cache-length 768 --trace-steps 8 --steps-per-call 8 --label distill-step"
}

extend_untrained() {  # extend_untrained GPU: the EXTEND_UNTRAINED sizes, one after another on GPU
  for size in $EXTEND_UNTRAINED; do
    CUDA_VISIBLE_DEVICES=$1 python3 -m eagle_jax.train --method eagle3 --init-head eagle_jax/heads/smollm2-135m-instruct-eagle3 \
      --draft-vocab-size "$size" --data "$run/distill" --output "$run/eagle3-vocab$size" --steps 0 --eval-prompts 0 &&
    CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/eagle.py --method eagle3 --draft "$run/eagle3-vocab$size/head" --max_num_seqs 1 \
      --num_prompts 80 --max_new_tokens 256 --num_spec_tokens 5,6 --out "$r/mtbench_eagle3-vocab$size.json"
  done
}
scaling() {  # scaling GPU: the SCALING_TOKENS points, one after another on GPU
  [ -n "$SCALING_TOKENS" ] || return 0
  local seconds=${SCALING_SECONDS:-200}
  read -r attention steps <<< "$(BATCH_SIZE= STEP_MS= sized eagle3 "$seconds")"  # from scratch, batch 64
  for tokens in $SCALING_TOKENS; do
    out="$run/scaling-$tokens"
    CUDA_VISIBLE_DEVICES=$1 python3 -m eagle_jax.train --method eagle3 --unroll 7 --attention "$attention" \
      --train-tokens "$tokens" --data "$run/distill-scaling" --output "$out" --steps "$steps" --batch-size 64 \
      --warmup-steps 200 --max-seconds "$seconds" --eval-prompts 0 && cp "$out/metrics.json" "$r/eagle3_scaling_${tokens}_metrics.json" &&
    CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/eagle.py --method eagle3 --draft "$out/head" --max_num_seqs 1 --num_prompts 80 \
      --max_new_tokens 256 --num_spec_tokens 5 --out "$r/scaling.json" &&
    python3 - "$r/scaling.json" "$out/metrics.json" "$steps" <<'EOF'
import json, sys  # the point's training, on its row (plot_results.py's data_scaling.png reads these)
rows, metrics = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
rows[-1].update(train_tokens=metrics["num_trained_tokens"], train_steps=metrics["steps"],
                scheduled_steps=int(sys.argv[3]), train_seconds=round(metrics["train_seconds"], 1))
open(sys.argv[1], "w").write(json.dumps(rows, indent=1) + "\n")
EOF
  done
}

# Greedy rounds 0-2 then T = 0.7 on GPU 0; sampled first turns on the other GPU (its own
# directory: nobody reads a part while another process writes it).
distill_extra() {  # distill_extra GPU: .stage/extra_turns.npz (eagle_jax.cli.prepare_data --extra-turns-out), if staged
  [ -f .stage/extra_turns.npz ] || return 0
  mkdir -p "$run/distill-extra"
  for part in "$run"/distill/extra-*.npz; do  # carried from an earlier machine: reused, not distilled again
    [ -f "$part" ] && cp -n "$part" "$run/distill-extra/${part#"$run"/distill/extra-}"
  done
  CUDA_VISIBLE_DEVICES=$1 python3 -m eagle_jax.cli.distill --turns .stage/extra_turns.npz --out "$run/distill-extra" \
    --max-prompt-tokens 384 --max-new-tokens 256 --batch-size 1024 --rounds 1 --temperatures "${EXTRA_TEMPERATURES:-0,0.8}" \
    --max-seconds "${DISTILL_SECONDS:-240}" --seed "${DISTILL_SEED:-0}"
  for part in "$run"/distill-extra/*.npz; do mv "$part" "$run/distill/extra-$(basename "$part")"; done
}

if [ -n "$SKIP_DISTILL" ]; then
  distill() { ls "$run/distill"; }  # the carried parts
fi
heads=${HEADS:-eagle3 eagle}
bench() {  # bench GPU [SECTION ...]: benchmarks/gpu_benchmark.sh on GPU (no sections: its own; "none": none),
  # rows in $r/gpuGPU/; a DRAFT head that failed to train leaves the shipped one
  [ "${2:-}" = none ] && return 0
  local draft=""; [ -d "${DRAFT:-}" ] && draft="--draft $DRAFT"
  CUDA_VISIBLE_DEVICES=$1 bash benchmarks/gpu_benchmark.sh --results "$r/gpu$1" $draft "${@:2}" \
    > "$r/benchmark_log_gpu$1.txt" 2>&1
}
if [ "$gpus" -ge 2 ] && [ "$heads" != eagle3 ] && [ -n "$SKIP_DISTILL" ]; then
  # Carried parts: EAGLE-1 trains on them at once on GPU 1, then that GPU runs BENCH_SECTIONS;
  # GPU 0 first distils the extra prompts (whole parts land by rename, long after GPU 1 read its data).
  ( distill_extra 0; train 0 eagle3 7; evaluate 0 eagle3 ) &
  ( train 1 eagle 3; evaluate 1 eagle; [ -z "$BENCH_SECTIONS" ] || bench 1 $BENCH_SECTIONS ) &
  wait
elif [ "$gpus" -ge 2 ] && [ "$heads" != eagle3 ]; then
  distill 0 "$run/distill" --rounds 3 --temperatures 0,0.7 &
  ( profile 1 eagle3 cudnn || profile 1 eagle3 xla; profile 1 eagle cudnn 3 || profile 1 eagle xla 3
    distill 1 "$run/distill-sampled" --rounds 1 --temperatures 0.8,1.0,0.9,0.6; distill_extra 1 ) &
  wait
  mv "$run"/distill-sampled/*.npz "$run/distill/" 2>/dev/null
  train 0 eagle3 7 & train 1 eagle 3 & wait
  evaluate 0 eagle3 & ( evaluate 1 eagle; trace_steps 1 ) & wait
else
  # The scaling runs read a fixed set of parts (links, taken before GPU 0 adds any), so their subsets nest.
  mkdir -p "$run/distill-scaling" && ln -f "$run"/distill/*.npz "$run/distill-scaling/" 2>/dev/null
  profile 0 eagle3 cudnn || profile 0 eagle3 xla  # before GPU 1 starts: its scaling runs read the step time
  if [ "$gpus" -ge 2 ] && [ -n "$GPU1_VARIANT" ]; then (variant 1; bench 1 $BENCH_SECTIONS) &
  elif [ "$gpus" -ge 2 ]; then (scaling 1; bench 1 $BENCH_SECTIONS) &
  fi
  distill 0 "$run/distill" --rounds "${DISTILL_ROUNDS:-3}" --temperatures "${DISTILL_TEMPERATURES:-0,0.8,1.0,0.7}"
  [ -n "$SKIP_DISTILL" ] || distill_extra 0  # SKIP_DISTILL: the carried parts alone
  extend_untrained 0
  train 0 eagle3 7
  evaluate 0 eagle3
  if [ "$gpus" -lt 2 ]; then  # one GPU: what GPU 1 would run, after the head (BENCH_SECTIONS, else the step traces)
    if [ -n "$BENCH_SECTIONS" ]; then bench 0 $BENCH_SECTIONS; else trace_steps 0; fi
    scaling 0
  fi
  wait
fi
ls -la "$run/distill"
