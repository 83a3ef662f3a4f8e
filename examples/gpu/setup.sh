#!/usr/bin/env bash
# Prepares a bare GPU machine (no network) for eagle_jax runs. Source it from the repo root:
#   source examples/gpu/setup.sh
# Expects, carried in the ignored folders .stage/ and .whl/ (see docs/GPU_RUNS.md):
#   .stage/gguf.part00, .stage/gguf.part01 (the SmolLM2 GGUF split under 60 MB; parts may arrive in
#   separate calls and are kept in /root/stage), .stage/tokenizer/, .whl/gguf-*.whl.
set -e
mkdir -p /root/stage
cp .stage/gguf.part* /root/stage/ 2>/dev/null || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export EAGLE_JAX_CACHE_DIR=/root/stage/cache
models=$EAGLE_JAX_CACHE_DIR/models
gguf=$models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ -f /root/stage/gguf.part01 ]; then
  mkdir -p "$models"
  cat /root/stage/gguf.part00 /root/stage/gguf.part01 > "$gguf"
  (cd "$models" && sed "s#  .*#  SmolLM2-135M-Instruct.Q4_1.gguf#" "$OLDPWD/.stage/gguf.sha256" | sha256sum -c -)
fi
if [ -f "$gguf" ] && [ ! -f "$models/SmolLM2-135M-Instruct-hf/model.safetensors" ]; then
  mkdir -p "$models/SmolLM2-135M-Instruct-hf"
  cp .stage/tokenizer/* "$models/SmolLM2-135M-Instruct-hf/"
  python3 -c "
from eagle_jax import gguf_file, hf_files
config, tensors = gguf_file.read_gguf('$gguf', progress=False)
hf_files.save_tensors(tensors, '$models/SmolLM2-135M-Instruct-hf/model.safetensors', metadata={'format': 'pt'})
print('model ready:', len(tensors), 'tensors')"
fi
python3 -c "import jax, flax, optax, orbax.checkpoint, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__)"
