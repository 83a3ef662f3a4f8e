"""Counts what continuous batching asks of the device: run, prefill and insert calls, syncs, host seconds.

    python benchmarks/continuous_calls.py [--num_prompts 24] [--slots 4] [--refill_at 1,2,4]

A tiny random Llama (and a random EAGLE-1 head for --k > 0) on whatever device JAX finds,
ragged prompt lengths and budgets. Prints `scheduler.CallCounts` per setting: a CPU stand-in for
the round trips that the GPU pays (each run call that ends is a device-to-host sync). No timing
here is meaningful beyond the host/sync split; the calls are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from flax import nnx

from eagle_jax.model import config as config_lib
from eagle_jax.model import eagle
from eagle_jax.serve import config as serve_config
from eagle_jax.serve import engine as engine_lib
from eagle_jax.model import llama


def tiny_models(k: int):
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=101, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu")
    cfg = config_lib.LlamaConfig.from_hf_config(hf)
    target = llama.Llama(cfg, rngs=nnx.Rngs(0))
    if not k:
        return target, None
    layer = config_lib.LlamaConfig(**{**cfg.__dict__, "num_layers": 1})
    return target, eagle.make_head(eagle.EagleConfig(method="eagle", layer=layer), rngs=nnx.Rngs(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_prompts", type=int, default=24)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--steps_per_call", type=int, default=16)
    parser.add_argument("--refill_at", default="", help="comma list of Engine refill_at values (default: the engine's)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 101, int(n)).tolist() for n in rng.integers(1, 31, args.num_prompts)]
    budgets = [int(b) for b in rng.integers(4, 48, args.num_prompts)]
    target, head = tiny_models(args.k)
    settings = [int(v) for v in args.refill_at.split(",") if v.strip()] or [None]
    outputs = None
    for refill_at in settings:
        extra = {} if refill_at is None else dict(refill_at=refill_at)
        engine = engine_lib.Engine(target, head, serve_config.EngineConfig(
            num_speculative_tokens=args.k, max_length=128, batch_size=args.slots, scheduler="continuous",
            steps_per_call=args.steps_per_call, **extra))
        engine.generate(prompts[:2], max_new_tokens=budgets[:2], ignore_eos=True)  # compiles
        began = time.perf_counter()
        results = engine.generate(prompts, max_new_tokens=budgets, ignore_eos=True)
        seconds = time.perf_counter() - began
        tokens = [r.token_ids for r in results]
        same = "" if outputs is None else f" same tokens as the first setting: {tokens == outputs}"
        outputs = outputs or tokens
        calls = results[0].calls
        print(f"refill_at={refill_at} slots={args.slots} k={args.k} prompts={args.num_prompts} "
              f"steps_per_call={args.steps_per_call}: {sum(map(len, tokens))} tokens in {seconds:.3f} s;"
              + "".join(f" {key}={value:.3f}" if isinstance(value, float) else f" {key}={value}"
                        for key, value in calls.items()) + same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
