"""The decoder stack of a one-token decode step: one persistent kernel against the fused kernels' launches.

    python benchmarks/persistent_bench.py --random-target config.json --out docs/results/persistent.json
    python benchmarks/persistent_bench.py --rows auto,8,16 --part-slots 128,256 --num-warps 4,8 --prefetch 1,0
    python benchmarks/persistent_bench.py --spin volatile,atomic --skip none,all,qkv,attend,o,gate_up,down

`kernels.persistent_layers.decode_layers` (every layer in one launch, grid barriers between its
stages) against the model's own cached call on the fused Pallas kernels (`layers.Kernels("pallas")`,
five or six launches a layer), both from the token's embedding to the final norm, batch 1, a
--cache-length cache whose first --position slots are filled. Each is timed as a device loop of
--steps calls in one program (the position advancing, caches donated), as the engine's run
programs loop: microseconds a call are the loop's wall time over its calls, best of --repeats.
Before timing, one call of each from the same state is compared: the final hidden state's largest
difference (bfloat16 rounds differently in the two) and whether both pick the same next token.
--skip leaves stages out of the persistent kernel, their barriers kept (a timing ablation: "all"
times the barriers alone, a stage's name the step without that stage's work; such rows are
wrong by design). Prints a table; --out appends JSON rows.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eagle_jax.io import models
from eagle_jax.kernels import grid_barrier
from eagle_jax.kernels import persistent_layers
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import rotary
from results_file import append_rows, error_field


def ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target directory (default SmolLM2-135M-Instruct)")
    parser.add_argument("--random-target", metavar="CONFIG_JSON", help="random weights of this config.json's shapes")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--cache-length", type=int, default=2048)
    parser.add_argument("--position", type=int, default=300, help="the first call's position (slots below it filled)")
    parser.add_argument("--steps", type=int, default=64, help="calls in one timed device loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="auto",
                        help="comma list: output features of a work item (auto: each stage's own, `work_rows`)")
    parser.add_argument("--part-slots", default="256", help="comma list: cache slots of an attention item")
    parser.add_argument("--num-warps", default="8", help="comma list")
    parser.add_argument("--programs", default="", help="comma list: grid sizes (default: the GPU's SMs)")
    parser.add_argument("--prefetch", default="1", help="comma list of 1 / 0: weights loaded ahead of the barriers")
    parser.add_argument("--spin", default="volatile", help="comma list: how the barriers poll (grid_barrier.SPINS)")
    parser.add_argument("--skip", default="none",
                        help="comma list of stage sets left out, each none, all or stages joined by '+' "
                             f"(of {', '.join(persistent_layers.STAGES)})")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)

    target, _ = models.target_or_random(args.model, args.random_target, args.dtype)
    cfg, dtype = target.config, target.embed_tokens.embedding[...].dtype
    inv_freq = rotary.rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, args.cache_length, cfg.num_kv_heads, cfg.head_dim)
    filled = (np.arange(args.cache_length) < args.position)[None, :, None, None]
    keys = jnp.asarray(np.where(filled, rng.standard_normal(shape), 0.0), dtype)
    values = jnp.asarray(np.where(filled, rng.standard_normal(shape), 0.0), dtype)
    stacked = persistent_layers.stack_layers(target)
    token = jnp.int32(17)

    # Each call takes and returns its own cache layout: per-layer buffers (the model's) or stacked.
    per_layer = kv_cache_lib.KVCache(keys=tuple(keys[:, None]), values=tuple(values[:, None]),
                                     lengths=jnp.full((1,), args.position, jnp.int32))

    def fused_call(cache, position):
        hidden, cache, _ = target(jnp.full((1, 1), token), jnp.full((1, 1), position, jnp.int32), cache,
                                  kernels=layers.Kernels("pallas"))
        return hidden[0, 0], cache

    def persistent_call(settings):
        def call(caches, position):
            x = target.embed_tokens(jnp.full((1, 1), token))[0, 0]
            x, *caches = persistent_layers.decode_layers(
                x, position, stacked, *caches, num_heads=cfg.num_heads, eps=cfg.rms_norm_eps, inv_freq=inv_freq,
                **settings)
            return target.norm(x.astype(dtype)), tuple(caches)
        return call

    def loop(call):
        def run(cache):
            def body(step, carry):
                hidden, cache = call(carry[0], jnp.int32(args.position) + step)
                return cache, hidden.astype(jnp.float32)
            return lax.fori_loop(0, args.steps, body, (cache, jnp.zeros((cfg.hidden_size,), jnp.float32)))
        return jax.jit(run, donate_argnums=0)

    def timed(call, cache) -> float:
        run = loop(call)
        state = run(jax.tree.map(jnp.copy, cache))  # compiles
        jax.block_until_ready(state)
        best = float("inf")
        for _ in range(args.repeats):
            began = time.perf_counter()
            state = run(state[0])
            jax.block_until_ready(state)
            best = min(best, time.perf_counter() - began)
        return best / args.steps * 1e6

    reference = jax.jit(fused_call)(per_layer, jnp.int32(args.position))[0].astype(jnp.float32)
    greedy = lambda hidden: int(jnp.argmax(target.logits(hidden.astype(dtype))))  # the next token each picks
    device = jax.devices()[0]
    common = dict(benchmark="persistent_layers", device=device.device_kind, jax_version=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  dtype=args.dtype, cache_length=args.cache_length, position=args.position, steps=args.steps,
                  layers=cfg.num_layers, label=args.label, model=args.random_target or args.model or "default")
    rows = [dict(common, kernel="fused kernels", us_per_call=timed(fused_call, per_layer),
                 max_abs_difference=0.0)]
    print(f"{'kernel':<46} {'us a call':>10} {'max |diff|':>11}")
    print(f"{rows[0]['kernel']:<46} {rows[0]['us_per_call']:>10.1f} {0.0:>11.4f}", flush=True)
    grids = ints(args.programs) or [grid_barrier.resident_programs()]
    spins = [value.strip() for value in args.spin.split(",") if value.strip()]
    skips = [() if value == "none" else persistent_layers.STAGES if value == "all" else tuple(value.split("+"))
             for value in (value.strip() for value in args.skip.split(",")) if value]
    settings_list = [dict(programs=programs, rows=rows_per_item, part_slots=part_slots, num_warps=num_warps,
                          prefetch=bool(prefetch), spin=spin, skip=skip)
                     for programs in grids
                     for rows_per_item in [None if value.strip() == "auto" else int(value)
                                           for value in args.rows.split(",")]
                     for part_slots in ints(args.part_slots) for num_warps in ints(args.num_warps)
                     for prefetch in ints(args.prefetch) for spin in spins for skip in skips]
    for settings in settings_list:
        label = (f"persistent {settings['programs']}p rows {settings['rows'] or 'auto'} part {settings['part_slots']} "
                 f"warps {settings['num_warps']}" + (" ahead" if settings["prefetch"] else "")
                 + (f" {settings['spin']}" if len(spins) > 1 else "")
                 + (f" skip {'+'.join(settings['skip'])}" if settings["skip"] else ""))
        try:
            call = persistent_call(settings)
            hidden = jax.jit(call)((keys, values), jnp.int32(args.position))[0].astype(jnp.float32)
            difference = float(jnp.max(jnp.abs(hidden - reference)))
            work = persistent_layers.work_rows(settings["programs"], stacked.qkv.shape[1], cfg.hidden_size,
                                               cfg.intermediate_size, settings["rows"])
            row = dict(common, kernel=label, **settings, work=work._asdict(), us_per_call=timed(call, (keys, values)),
                       max_abs_difference=difference, same_next_token=greedy(hidden) == greedy(reference),
                       reference_max_abs=float(jnp.max(jnp.abs(reference))))
        except Exception as error:  # a setting that does not compile is a row too
            row = dict(common, kernel=label, **settings, error=error_field(error))
        rows.append(row)
        if "error" in row:
            print(f"{label:<46} {row['error'][:120]}", flush=True)
        else:
            print(f"{label:<46} {row['us_per_call']:>10.1f} {row['max_abs_difference']:>11.4f}", flush=True)
    if args.out:
        append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
