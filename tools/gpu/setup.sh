#!/usr/bin/env bash
# Prepares a bare GPU machine (no network) for eagle_jax runs. Source it from the repo root:
#   source tools/gpu/setup.sh
# Expects, carried in the ignored folders .stage/ and .whl/ (tools/gpu/README.md, stage_local.sh):
#   .stage/gguf.partNN (the SmolLM2 GGUF split so each call's tree stays under 64 MB; parts may
#   arrive in separate calls), .stage/gguf.sha256, .whl/gguf-*.whl.
# Once the GGUF is whole, the model is converted where eagle_jax looks for it
# (`default_model.default_model_dir()`: <cache>/models/gguf-<sha256>, tokenizer included) and
# EAGLE_JAX_MODEL_DIR names that HF directory, for what reads one directly (the torch peer).
set -e
# Whatever each call carries in .stage accumulates in /root/stage, which .stage then points to.
mkdir -p /root/stage
if [ -d .stage ] && [ ! -L .stage ]; then cp -r .stage/. /root/stage/ && rm -rf .stage; fi
ln -sfn /root/stage .stage
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export EAGLE_JAX_CACHE_DIR=/root/stage/cache
models=$EAGLE_JAX_CACHE_DIR/models
gguf=$models/SmolLM2-135M-Instruct.Q4_1.gguf  # where default_model.default_gguf_path() finds it offline
if [ ! -f "$gguf" ]; then  # join once every part has arrived (the checksum says so)
  mkdir -p "$models"
  cat /root/stage/gguf.part* > "$gguf.joining"
  if [ "$(sha256sum < "$gguf.joining" | cut -d' ' -f1)" = "$(cut -d' ' -f1 .stage/gguf.sha256)" ]; then
    mv "$gguf.joining" "$gguf"; echo "gguf joined"
  else
    rm "$gguf.joining"; echo "gguf parts so far: $(ls /root/stage | grep -c "^gguf.part")"
  fi
fi
if [ -f "$gguf" ]; then  # converts on the first call only; later calls find the conversion by the file's sha256
  EAGLE_JAX_MODEL_DIR=$(python3 -c "from eagle_jax.io import default_model; print(default_model.default_model_dir())")
  export EAGLE_JAX_MODEL_DIR
  echo "model ready: $EAGLE_JAX_MODEL_DIR"
fi
# Distilled parts carried from an earlier machine (stage_local.sh carry): unpacked into the run folder
# once every tar part has arrived; their names go to .carried, so collect.sh does not send them back.
carried=/root/stage/run/distill
if compgen -G "/root/stage/distill.tar.part*" > /dev/null && [ ! -f "$carried/.carried" ]; then
  if [ "$(cat /root/stage/distill.tar.part* | sha256sum | cut -d' ' -f1)" = "$(cut -d' ' -f1 /root/stage/distill.sha256)" ]; then
    mkdir -p "$carried" && cat /root/stage/distill.tar.part* | tar -xf - -C "$carried"
    (cd "$carried" && ls -- *.npz > .carried) && echo "carried distilled parts: $(wc -l < "$carried/.carried")"
  else
    echo "distilled tar parts so far: $(ls /root/stage/distill.tar.part* | wc -l)"
  fi
fi
python3 -c "import jax, flax, optax, orbax.checkpoint, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__)"
