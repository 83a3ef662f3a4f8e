"""A tiny random model served by `python -m eagle_jax.serve` from this checkout, for load scripts on a CPU.

`tiny_model` writes the model (the server tests' word-level tokenizer, a three-layer Llama) and an
EAGLE-1 head; `started_server` serves them on a free port and waits on /health, never on a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.cli.test_generate_cli`, whose tokenizer the model reuses
    sys.path.insert(0, str(ROOT))
VOCAB = 101  # the server tests' word-level tokenizer's
K = 2  # drafted tokens per step


def tiny_model(directory: Path) -> tuple[Path, Path]:
    """A converted tiny Llama and an EAGLE-1 head for it, as the server tests' aligned model and
    agreeing head (tests/conftest.py): random, but next tokens close to lm_head(embed(t)), which
    the head drafts with noise. Special tokens' lm_head columns are 0, so greedy decoding never
    emits them and every token decodes to one word."""
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax.io import models
    from eagle_jax.model import config as config_lib
    from eagle_jax.model import eagle
    from tests.cli import test_generate_cli

    source = directory / "source"
    source.mkdir(parents=True)
    hidden = 32
    (source / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, hidden_act="silu")))
    test_generate_cli.save_tokenizer(source, VOCAB)
    target = models.random_target(source / "config.json")
    rng = np.random.default_rng(14)
    put = lambda param, value: param.__setitem__(..., jnp.asarray(value, jnp.float32))
    embeddings = rng.standard_normal((VOCAB, hidden))
    put(target.embed_tokens.embedding, embeddings / np.sqrt(np.mean(embeddings ** 2, -1, keepdims=True)))
    put(target.norm.weight, np.ones(hidden))
    for layer in target.layers:
        put(layer.self_attn.o_proj.kernel, 0.1 * np.asarray(layer.self_attn.o_proj.kernel[...]))
        put(layer.mlp.down_proj.kernel, 0.1 * np.asarray(layer.mlp.down_proj.kernel[...]))
    lm_head = rng.standard_normal((hidden, VOCAB)) / np.sqrt(hidden)
    lm_head[:, :len(test_generate_cli.SPECIALS)] = 0
    put(target.lm_head.kernel, lm_head)
    model_dir = models.save_converted(target, source, directory / "model")
    layer = config_lib.LlamaConfig(**{**target.config.__dict__, "num_layers": 1})
    head = eagle.make_head(eagle.EagleConfig(method="eagle", layer=layer), rngs=nnx.Rngs(14))
    fc = np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))])
    put(head.fc.kernel, fc + 0.3 * rng.standard_normal(fc.shape) / np.sqrt(2 * hidden))
    return model_dir, models.export_head(head, target.config, directory / "head", dtype="float32")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def started_server(directory: Path, max_num_seqs: int = 8, steps_per_call: int = 2, deadline_seconds: float = 900):
    """Serves `tiny_model` from this checkout on a free port; yields (url, its flags) once /health says ready.

    `directory` takes the model, the compile cache and the server's log. SIGTERM at the end: the
    server finishes what is in flight, then exits.
    """
    import httpx

    model_dir, head_dir = tiny_model(directory)
    port = free_port()
    flags = ["--num-speculative-tokens", str(K), "--max-num-seqs", str(max_num_seqs), "--steps-per-call",
             str(steps_per_call), "--max-length", "256", "--served-model-name", "tiny"]
    command = [sys.executable, "-m", "eagle_jax.serve", "--model", str(model_dir), "--draft", str(head_dir),
               "--port", str(port), "--cache-dir", str(directory / "xla"), *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log_path = directory / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            began = time.monotonic()
            while True:  # readiness, not a guess: /health is 200 once every program is compiled
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited with {process.returncode}: {log_path.read_text()[-3000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() - began > deadline_seconds:
                    raise RuntimeError(f"the server was not ready in {deadline_seconds} s; see {log_path}")
                time.sleep(0.2)
            yield url, flags
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # drains what is in flight, then exits
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
