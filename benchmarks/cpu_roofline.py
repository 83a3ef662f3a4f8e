"""How close plain decoding comes to this machine's memory bandwidth: the portable CPU figure.

    python benchmarks/cpu_roofline.py --out docs/results/cpu.json

A batch-1 decode step must read every weight once (and the filled part of the KV cache), so
its floor is bytes / bandwidth. This script measures, in one process and with the same XLA
thread pool as decoding, (1) the copy bandwidth of a 1 GiB float32 array through a jitted
`x + 1` (bytes read + bytes written per second, METHOD.md's convention) and (2) the decode step
time of the default model, then reports the achieved read bandwidth (bytes a step reads / step
time) as a fraction of the copy bandwidth. The ratio to HF transformers depends on the machine;
this fraction much less so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.cli import errors as script_errors
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs
from eagle_jax.io import models
from results_file import append_rows


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes read + written per second by a jitted elementwise pass over `gib` GiB (best of `repeats`)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    # Donated, so the output reuses the input's pages: a fresh 1 GiB output each call would time
    # the kernel's page faults, not the memory.
    add_one = jax.jit(lambda a: a + 1, donate_argnums=0)
    x = add_one(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        x = add_one(x).block_until_ready()
        best = min(best, time.perf_counter() - began)
    return 2 * x.nbytes / best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="float32")
    parser.add_argument("--prompt_tokens", "--prompt-tokens", type=int, default=64)
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations; the fastest counts")
    parser.add_argument("--out", default="docs/results/cpu.json")
    args = parser.parse_args(argv)
    target, _ = models.load_target(None, args.dtype)
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(target)))
    cfg = target.config
    max_length = inputs.bucket_length(args.prompt_tokens + args.max_new_tokens + 1, cfg.max_position_embeddings)
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=max_length))
    prompt = np.arange(10, 10 + args.prompt_tokens, dtype=np.int32)
    engine.generate([prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True)  # compile
    # Best of a few runs, as for the copy: on a shared machine single runs varied from 39 to 67 ms
    # a step. Prefill is included, so this is an upper bound on the step.
    seconds_per_token = []
    for _ in range(args.repeats):
        [result] = engine.generate([prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True)
        seconds_per_token.append(result.seconds / result.num_tokens)
    step_seconds = min(seconds_per_token)
    # KV read by the average step: keys and values of every layer over the filled slots.
    filled = args.prompt_tokens + args.max_new_tokens / 2
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * filled * np.dtype(args.dtype).itemsize
    bandwidth = copy_bandwidth()
    achieved = (param_bytes + kv_bytes) / step_seconds
    device = jax.devices()[0]
    row = dict(kind="cpu_roofline", dtype=args.dtype, repeats=args.repeats, bytes_per_step=int(param_bytes + kv_bytes),
               step_ms=round(step_seconds * 1e3, 2), tokens_per_second=round(1 / step_seconds, 2),
               achieved_gb_per_s=round(achieved / 1e9, 2), copy_gb_per_s=round(bandwidth / 1e9, 2),
               fraction_of_copy_bandwidth=round(achieved / bandwidth, 3), cpu_count=os.cpu_count(),
               device=device.device_kind, platform=device.platform, jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + shlex.join(sys.argv))
    append_rows(args.out, [row])
    print(f"step {row['step_ms']} ms reading {row['bytes_per_step'] / 1e6:.0f} MB: {row['achieved_gb_per_s']} GB/s "
          f"= {row['fraction_of_copy_bandwidth']:.0%} of the copy bandwidth ({row['copy_gb_per_s']} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
