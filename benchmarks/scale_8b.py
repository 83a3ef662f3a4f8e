"""Llama-3.1-8B-shaped timings with random bf16 weights, and an 8B throughput PROJECTION.

    python benchmarks/scale_8b.py --cache-length 1024 --filled 512 --ks 1,2,3,4,5,6,7
    python benchmarks/scale_8b.py --tiny   # a small model of the same structure, for CPU tests
    python benchmarks/scale_8b.py --ks 1,3,5 --tensor_parallel_size 1,2   # each step on 1 and on 2 GPUs

The target (hidden 4096, 32 layers, 32 heads / 8 kv heads of 128, FFN 14336, vocab 128256,
llama3 rope scaling) and its heads (EAGLE-1: one layer of the same shape with fc 8192->4096;
EAGLE-3: the midlayer over 2x4096 inputs, fc 3x4096->4096, own 32k-token lm_head) get random
weights generated on the device inside one jitted function (nothing is materialised on the
host). With jit, batch 1, a cache of `--cache-length` slots of which `--filled` are committed:
  * decode: one target forward of 1 token + lm_head + argmax (a plain decoding step);
  * verify(k): the same over k+1 tokens;
  * draft step: one head forward of 1 token + its lm_head (the target's 128256-token one for
    EAGLE-1) + argmax, the unit the draft loop repeats.
Each is compared with its HBM floor: (weight bytes read + KV bytes read) / copy bandwidth,
the bandwidth measured here with a large on-device array op (bytes read + written / time).
Then, using acceptance lengths measured with SmolLM2-135M on MT-Bench (docs/results/mtbench_h200.json),
projected tokens/s = acceptance_length(k) / (k * draft_step + verify(k)). That is a projection
for a hypothetical 8B pair with SmolLM2's acceptance, not a measurement of a trained 8B head.
With `--tensor_parallel_size 1,2` every measurement runs once per size, the target split
Megatron-style over that many devices (`eagle_jax.sharding`) and the heads replicated (with
`--split_heads`, their MLPs and EAGLE-3's draft vocabulary split too: `sharding.shard_head`); rows
carry `tensor_parallel_size` (draft steps also `draft_tensor_parallel_size`), and floors count
the bytes one device reads (its shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
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
import tqdm
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from eagle_jax.model import config as config_lib
from eagle_jax.model import eagle
from eagle_jax.model import llama
from eagle_jax.serve import sharding
from eagle_jax.cli import errors as script_errors
from results_file import append_rows

LLAMA_31_8B = config_lib.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=config_lib.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192),
    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)
TINY = dataclasses.replace(LLAMA_31_8B, vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=64)
EAGLE3_DRAFT_VOCAB = {"full": 32000, "tiny": 500}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cache-length", type=int, default=1024, help="KV cache slots (attention reads them all)")
    parser.add_argument("--filled", type=int, default=512, help="committed tokens in the cache")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7", help="comma list of k for verify(k)")
    parser.add_argument("--methods", default="eagle,eagle3", help="heads whose draft step is timed")
    parser.add_argument("--iterations", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--steps_per_call", "--steps-per-call", type=int, default=1,
                        help="steps per timed call, in one program (a fori_loop, as the Engine's device loop); "
                             "times are per step. A call's fixed launch cost, larger on several GPUs, is "
                             "then shared by the steps as it is in generation")
    parser.add_argument("--copy-gib", type=float, help="array size for the bandwidth test (default 4, --tiny 0.0625)")
    parser.add_argument("--results", default="docs/results/mtbench_h200.json", help="acceptance lengths for the projection")
    parser.add_argument("--tensor_parallel_size", "--tensor-parallel-size", default="1",
                        help="comma list of devices to split the target over (Megatron-style); each is measured")
    parser.add_argument("--split_heads", "--split-heads", action="store_true",
                        help="split the heads' MLPs and EAGLE-3's draft vocabulary too (sharding.shard_head); "
                             "default: each head whole on every device")
    parser.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, vocab 1000: a CPU smoke test")
    parser.add_argument("--out", default="docs/results/profile_h200.json", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    args.ks = sorted({int(part) for part in args.ks.split(",") if part.strip()})
    args.methods = [part.strip() for part in args.methods.split(",") if part.strip()]
    args.tensor_parallel_size = [int(part) for part in args.tensor_parallel_size.split(",") if part.strip()]
    if not args.tensor_parallel_size or min(args.tensor_parallel_size) < 1:
        parser.error("--tensor_parallel_size must list sizes >= 1")
    if bad := [m for m in args.methods if m not in ("eagle", "eagle3")]:
        parser.error(f"--methods must be among eagle, eagle3; got {bad}")
    if args.steps_per_call < 1:
        parser.error("--steps_per_call must be >= 1")
    if not args.ks or min(args.ks) < 1:
        parser.error("--ks must list k >= 1")
    if args.filled + max(args.ks) + 1 > args.cache_length:
        parser.error("--filled + max k + 1 must fit in --cache-length")
    if args.copy_gib is None:
        args.copy_gib = 0.0625 if args.tiny else 4.0
    return args


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_leaf(key, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):  # EAGLE-3 d2t: the identity map
        return jnp.zeros(shape, dtype)
    if len(shape) == 1:  # norm scales (and biases): ones keep activations in range
        return jnp.ones(shape, dtype)
    return 0.02 * jax.random.normal(key, shape, dtype)


def random_module(factory, seed: int):
    """Builds `factory()` with random weights generated on the device (shapes from `nnx.eval_shape`).

    One small jitted generator per distinct shape (a few, since layers repeat) rather than one
    program for the whole model: that one took a minute to compile at 8B.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(factory))
    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    values = [_random_leaf(key, tuple(leaf.shape), jnp.dtype(leaf.dtype)) for key, leaf in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.block_until_ready(values)))


def nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def compile_and_time(function, args: tuple, iterations: int, desc: str, carry_index: int | None = None,
                     placed: dict | None = None):
    """(median ms, compile seconds) of a jitted function; output `carry_index` feeds back as donated input.
    `placed`, if given, receives the program's collectives (`sharding.collectives`)."""
    began = time.perf_counter()
    donate = () if carry_index is None else (len(args) - 1,)
    compiled = jax.jit(function, donate_argnums=donate).lower(*args).compile()
    compile_seconds = time.perf_counter() - began
    if placed is not None:
        placed.update(sharding.collectives(compiled.as_text()))
    args, times = list(args), []
    for index in tqdm.trange(3 + iterations, desc=desc, leave=False, file=sys.stderr):
        began = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        if index >= 3:
            times.append(time.perf_counter() - began)
        if carry_index is not None:
            args[-1] = out[carry_index]
    return 1e3 * float(np.median(times)), compile_seconds, args[-1]


def copy_bandwidth(gib: float, iterations: int) -> float:
    """Bytes read + written per second by an elementwise op over a large bf16 array."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    ms, _, _ = compile_and_time(lambda x: x + jnp.bfloat16(1), (x,), iterations, "bandwidth")
    return 2 * x.nbytes / (ms / 1e3)


def kv_bytes(cfg: config_lib.LlamaConfig, num_layers: int, slots: int) -> int:
    return 2 * num_layers * slots * cfg.num_kv_heads * cfg.head_dim * 2  # keys + values, bf16


def load_acceptance(path: str) -> dict[tuple[str, int], float]:
    """(method, k) -> acceptance length from the latest matching SmolLM2 MT-Bench row."""
    path = Path(path)
    if not path.is_file():
        return {}
    found = {}
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON list of result rows ({error})") from None
    for row in rows:
        if (row.get("method") in ("eagle", "eagle3") and row.get("batch_size") == 1 and row.get("mode") == "compiled"
                and float(row.get("temperature", 0)) == 0 and row.get("acceptance_length")
                and "speculative_eagle_topk" not in row):  # chains only: a tree's k is its depth
            found[(row["method"], int(row["k"]))] = float(row["acceptance_length"])  # later rows win
    return found


def shard_bytes(tree) -> int:
    """Bytes one device holds of `tree`: what it reads per step when the tree is split over several."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def head_config(cfg: config_lib.LlamaConfig, method: str, tiny: bool) -> eagle.EagleConfig:
    layer = dataclasses.replace(cfg, num_layers=1)
    if method == "eagle3":
        draft_vocab_size = EAGLE3_DRAFT_VOCAB["tiny" if tiny else "full"]
        return eagle.EagleConfig(method="eagle3", layer=layer, draft_vocab_size=draft_vocab_size,
                                 target_hidden_size=cfg.hidden_size,
                                 feature_layers=eagle.default_feature_layers(cfg.num_layers))
    return eagle.EagleConfig(method="eagle", layer=layer, fc_bias=False)


def measure(target: llama.Llama, heads: dict, mesh, args, bandwidth: float, record,
            tensor_parallel_size: int) -> dict:
    """Times decode, verify(k) and each head's draft step with the target split over `mesh` (None: one device).

    Floors count the bytes one device reads: its shard of the target and of the head (the whole
    head unless --split_heads).

    Returns:
        {"verify": {width: ms}, "draft": {method: ms}}.
    """
    cfg = target.config
    if mesh is not None:
        target = sharding.shard_target(target, mesh)
        place_head = sharding.shard_head if args.split_heads else sharding.replicate
        heads = {method: place_head(head, mesh) for method, head in heads.items()}
    target_def, target_params = nnx.split(target)
    row_bytes = cfg.hidden_size * 2
    target_read = shard_bytes(target_params) - shard_bytes(target.embed_tokens.embedding[...])  # gathers T rows

    def cache_shardings(cache, split: bool):
        """Where a cache lives on the mesh: the target's split like its attention, the head's replicated."""
        if split:
            return sharding.cache_shardings(cache, cfg, mesh)
        return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), cache)

    def filled_cache(cache, split: bool):
        cache = cache.replace(lengths=jnp.full((1,), args.filled, jnp.int32))
        return cache if mesh is None else jax.device_put(cache, cache_shardings(cache, split))

    def pin(cache, split: bool):
        """The output cache kept where the input was, so that it feeds the next call as compiled."""
        return cache if mesh is None else jax.lax.with_sharding_constraint(cache, cache_shardings(cache, split))

    def verify(params, tokens, cache):
        model = nnx.merge(target_def, params)
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        hidden, cache, _ = model(tokens, positions, cache)  # lengths unchanged: every call does the same work
        return jnp.argmax(model.logits(hidden), axis=-1).astype(jnp.int32), pin(cache, split=True)

    def repeat(step, num_params: int):
        """`step(*params, *carry) -> carry`, --steps_per_call times in one program."""
        if args.steps_per_call == 1:
            return step

        def run(*call_args):
            params, carry = call_args[:num_params], tuple(call_args[num_params:])
            return jax.lax.fori_loop(0, args.steps_per_call, lambda _, carry: step(*params, *carry), carry)
        return run

    cache = filled_cache(target.init_cache(1, args.cache_length, jnp.bfloat16), split=True)
    kv_per_slot = shard_bytes((cache.keys, cache.values)) / args.cache_length
    verify_ms = {}
    for width in tqdm.tqdm(sorted({1} | {k + 1 for k in args.ks}), desc="verify widths", file=sys.stderr):
        tokens = jnp.ones((1, width), jnp.int32)
        placed = {}
        ms, compile_seconds, cache = compile_and_time(repeat(verify, 1), (target_params, tokens, cache),
                                                      args.iterations, f"verify {width}", carry_index=1, placed=placed)
        ms /= args.steps_per_call
        verify_ms[width] = ms
        weights = target_read + width * row_bytes
        floor_ms = 1e3 * (weights + kv_per_slot * (args.filled + width)) / bandwidth
        floor_full_ms = 1e3 * (weights + kv_per_slot * args.cache_length) / bandwidth
        row = dict(what="decode" if width == 1 else "verify", ms=round(ms, 4), tokens=width,
                   floor_ms=round(floor_ms, 4), ratio_to_floor=round(ms / floor_ms, 3),
                   floor_full_cache_ms=round(floor_full_ms, 4), weight_bytes=weights,
                   compile_seconds=round(compile_seconds, 2), tensor_parallel_size=tensor_parallel_size,
                   collectives=placed)
        if width > 1:
            row["k"] = width - 1
        record(row)

    draft_ms = {}
    for method, head in heads.items():
        head_def, head_params = nnx.split(head)

        def draft_step(target_params, head_params, token, feature, cache):
            model, head = nnx.merge(target_def, target_params), nnx.merge(head_def, head_params)
            out, logits, cache = head(token[:, None], feature[:, None], cache.lengths[:, None], cache, model)
            next_token = head.to_target_ids(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
            return next_token, out[:, 0].astype(feature.dtype), pin(cache, split=False)

        draft_cache = filled_cache(eagle.init_cache(head.config, 1, args.cache_length, jnp.bfloat16), split=False)
        draft_kv = shard_bytes((draft_cache.keys, draft_cache.values)) * (args.filled + 1) / args.cache_length
        token, feature = jnp.ones((1,), jnp.int32), jnp.ones((1, cfg.hidden_size), jnp.bfloat16)
        placed = {}
        ms, compile_seconds, _ = compile_and_time(repeat(draft_step, 2),
                                                  (target_params, head_params, token, feature, draft_cache),
                                                  args.iterations, f"draft step {method}", carry_index=2, placed=placed)
        ms /= args.steps_per_call
        draft_ms[method] = ms
        head_read = shard_bytes(head_params) + row_bytes
        if method == "eagle":
            head_read += shard_bytes(target.lm_head.kernel[...])  # EAGLE-1 drafts through the target's lm_head
        else:
            head_read -= shard_bytes(head.fc.kernel[...])  # EAGLE-3's fc projects target features in the verify
        floor_ms = 1e3 * (head_read + draft_kv) / bandwidth
        record(dict(what="draft_step", method=method, ms=round(ms, 4), floor_ms=round(floor_ms, 4),
                    ratio_to_floor=round(ms / floor_ms, 3), weight_bytes=head_read,
                    head_bytes=shard_bytes(head_params), compile_seconds=round(compile_seconds, 2),
                    tensor_parallel_size=tensor_parallel_size, collectives=placed,
                    draft_tensor_parallel_size=tensor_parallel_size if args.split_heads and mesh is not None else 1))
    return dict(verify=verify_ms, draft=draft_ms)


def project(measured: dict, acceptance: dict, args, record, tensor_parallel_size: int) -> list[dict]:
    """Projection rows: acceptance_length(k) / (k draft steps + verify(k)), against plain decoding."""
    verify_ms, draft_ms = measured["verify"], measured["draft"]
    plain_otps = 1e3 / verify_ms[1]
    projections = []
    for method in args.methods:
        for k in args.ks:
            if (method, k) not in acceptance:
                continue
            step_ms = k * draft_ms[method] + verify_ms[k + 1]
            otps = 1e3 * acceptance[(method, k)] / step_ms
            row = dict(what="projection", method=method, k=k, acceptance_length_smollm2=acceptance[(method, k)],
                       projected_step_ms=round(step_ms, 4), projected_output_tokens_per_second=round(otps, 1),
                       plain_output_tokens_per_second=round(plain_otps, 1),
                       projected_speedup=round(otps / plain_otps, 3), tensor_parallel_size=tensor_parallel_size,
                       note="PROJECTION: 8B-shaped timings x SmolLM2-135M acceptance lengths, not a measured 8B run")
            record(row)
            projections.append(row)
    return projections


def main(argv=None) -> int:
    args = parse_args(argv)
    acceptance = load_acceptance(args.results)  # before measuring: a bad results file fails fast
    meshes = {size: sharding.make_mesh(size) if size > 1 else None for size in args.tensor_parallel_size}
    cfg = TINY if args.tiny else LLAMA_31_8B
    label = "tiny" if args.tiny else "llama-3.1-8b"
    dtype = jnp.bfloat16
    device = jax.devices()[0]
    meta = dict(kind="scale_8b", model_shape=label, device=device.device_kind, platform=device.platform,
                jax_version=jax.__version__, dtype="bfloat16", cache_length=args.cache_length, filled=args.filled,
                batch_size=1, iterations=args.iterations, steps_per_call=args.steps_per_call,
                xla_flags=os.environ.get("XLA_FLAGS") or None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python benchmarks/scale_8b.py " + shlex.join(sys.argv[1:]))
    rows = []

    def record(row: dict) -> None:
        rows.append(dict(row, **meta))
        if "ms" in row:
            text = f"{row['ms']:.3f} ms (floor {row['floor_ms']:.3f} ms, {row['ratio_to_floor']:.2f}x)"
        elif "bytes_per_second" in row:
            text = f"{row['bytes_per_second'] / 1e12:.3f} TB/s"
        else:
            text = f"projected {row['projected_output_tokens_per_second']:.1f} tok/s ({row['projected_speedup']:.2f}x)"
        name = row["what"] + (f" {row['method']}" if "method" in row else "") + (f" k={row['k']}" if "k" in row else "")
        name += f" tp={row['tensor_parallel_size']}" if "tensor_parallel_size" in row else ""
        print(f"[scale_8b.py] {name}: {text}", file=sys.stderr)

    bandwidth = copy_bandwidth(args.copy_gib, args.iterations)
    record(dict(what="copy_bandwidth", bytes_per_second=bandwidth, gib=args.copy_gib))

    began = time.perf_counter()
    target = random_module(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype), seed=0)
    print(f"[scale_8b.py] target: {nbytes(nnx.state(target)) / 1e9:.2f} GB of bf16 weights, random init "
          f"{time.perf_counter() - began:.1f} s", file=sys.stderr)
    heads = {method: random_module(lambda: eagle.make_head(head_config(cfg, method, args.tiny), rngs=nnx.Rngs(1),
                                                           dtype=dtype, param_dtype=dtype), 1)
             for method in args.methods}
    projections = []
    for size, mesh in meshes.items():
        measured = measure(target, heads, mesh, args, bandwidth, record, tensor_parallel_size=size)
        projections += project(measured, acceptance, args, record, tensor_parallel_size=size)
    if not acceptance:
        print(f"[scale_8b.py] no EAGLE rows (batch 1, compiled, temperature 0) in {args.results}: no projection",
              file=sys.stderr)

    append_rows(args.out, rows)
    print(f"\n{label}: copy bandwidth {bandwidth / 1e12:.3f} TB/s; cache {args.cache_length}, filled {args.filled}")
    print(f"{'what':<18}{'k':>3}{'tp':>4}{'ms':>10}{'floor ms':>10}{'x floor':>9}")
    for row in rows:
        if "ms" in row:
            print(f"{row['what'] + (' ' + row['method'] if 'method' in row else ''):<18}{row.get('k', ''):>3}"
                  f"{row['tensor_parallel_size']:>4}{row['ms']:>10.3f}{row['floor_ms']:>10.3f}"
                  f"{row['ratio_to_floor']:>9.2f}")
    if projections:
        print("\nPROJECTION (8B-shaped timings, SmolLM2-135M acceptance)")
        print(f"{'method':<8}{'k':>3}{'tp':>4}{'accept len':>12}{'step ms':>10}{'tok/s':>9}{'plain':>9}{'speedup':>9}")
        for row in projections:
            print(f"{row['method']:<8}{row['k']:>3}{row['tensor_parallel_size']:>4}"
                  f"{row['acceptance_length_smollm2']:>12.3f}{row['projected_step_ms']:>10.3f}"
                  f"{row['projected_output_tokens_per_second']:>9.1f}{row['plain_output_tokens_per_second']:>9.1f}"
                  f"{row['projected_speedup']:>9.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(script_errors.run(main))
