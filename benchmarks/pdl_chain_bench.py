"""A chain of dependent kernels: what programmatic dependent launch takes off each kernel's fixed cost.

    python benchmarks/pdl_chain_bench.py --kernels 200 --steps 32 --out docs/results/pdl_chain.json

A decode step at batch 1 is ~200 dependent kernels, each reading a slab of weights that no kernel
writes and a vector that the kernel before it wrote, each taking 3-6 us where its bytes need well
under one. Here a chain of --kernels such links (each its own weights, [--programs, --rows, 256]
bfloat16: together past the L2 cache, as a step's layers are) runs --steps times in one device
loop, as the engine's step loop runs. Variants (--variants):

  * triton: a Pallas Triton kernel, the link as our fused kernels are written (XLA launches it,
    and with its PDL flag on waits for the kernel before at its very start)
  * triton_early: the same kernel letting the next one launch as it starts (an inline
    `griddepcontrol.launch_dependents`, its output feeding the indexing so that it stays): the
    next kernel's launch overlaps this one, its work still waits at its start
  * mosaic: a Pallas Mosaic GPU kernel: its weights copied to shared memory by the TMA, then the
    vector read
  * mosaic_pdl: the same kernel, which lets the next kernel launch at once
    (`griddepcontrol.launch_dependents`) and waits for the one before (`griddepcontrol.wait`)
    only after its weights' copy is issued: the weights' latency overlaps the previous kernel

Each program of a link computes y = x / 2 + (sum(x) 1e-3 + sum(its weights) 1e-6) over its 128
values of the vector, checked against jnp on the first call. Prints us a kernel (the loop's wall
time over steps x kernels, best of --repeats); --out appends JSON rows.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmg
from jax.experimental.pallas import triton as pltr

from results_file import append_rows

WIDTH = 256  # a weight slab's row: one TMA box wide
LANES = 128  # values of the vector a program writes: one warpgroup's
VARIANTS = ("triton", "triton_early", "mosaic", "mosaic_pdl")


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """A link in jnp: y = x / 2 + (sum(x) 1e-3 + sum(program's weights) 1e-6), by program."""
    programs = w.shape[0]
    extra = jnp.sum(x) * 1e-3 + jnp.sum(w.astype(jnp.float32), axis=(1, 2)) * 1e-6
    return (x.reshape(programs, LANES) * 0.5 + extra[:, None]).reshape(-1)


def _mosaic_body(x_ref, w_ref, y_ref, w_smem, barrier, *, pdl: bool):
    program = lax.axis_index("programs")
    if pdl:  # the next link may launch now; it waits for this one before reading what it wrote
        plmg.griddepcontrol_launch_dependents()
    plmg.copy_gmem_to_smem(w_ref.at[program], w_smem, barrier)  # no kernel writes the weights
    if pdl:
        plmg.griddepcontrol_wait()  # the kernel before has finished and its stores are visible
    total = jnp.sum(x_ref[...])
    plmg.barrier_wait(barrier)
    extra = total * 1e-3 + jnp.sum(w_smem[...].astype(jnp.float32)) * 1e-6
    y_ref[pl.ds(program * LANES, LANES)] = x_ref[pl.ds(program * LANES, LANES)] * 0.5 + extra


def mosaic_link(x: jax.Array, w: jax.Array, pdl: bool) -> jax.Array:
    programs, rows, width = w.shape
    return plmg.kernel(functools.partial(_mosaic_body, pdl=pdl), out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(programs,), grid_names=("programs",),
                       scratch_types=[plmg.SMEM((rows, width), w.dtype), plmg.Barrier()])(x, w)


def _triton_body(x_ref, w_ref, y_ref, *, early: bool):
    program = pl.program_id(0)
    rows, width = w_ref.shape[1:]
    lanes = jnp.arange(LANES)
    if early:  # inline asm is pure to Pallas: a result nothing used would be dropped
        [lanes] = pltr.elementwise_inline_asm("griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[lanes],
                                              constraints="=r,r", pack=1,
                                              result_shape_dtypes=[jax.ShapeDtypeStruct((LANES,), jnp.int32)])
    weights = pltr.load(w_ref.at[program, jnp.arange(rows)[:, None], jnp.arange(width)[None, :]])
    total = jnp.sum(pltr.load(x_ref.at[jnp.arange(x_ref.shape[0])]))
    mine = program * LANES + lanes
    extra = total * 1e-3 + jnp.sum(weights.astype(jnp.float32)) * 1e-6
    pltr.store(y_ref.at[mine], pltr.load(x_ref.at[mine]) * 0.5 + extra)


def triton_link(x: jax.Array, w: jax.Array, early: bool = False, interpret: bool = False) -> jax.Array:
    return pl.pallas_call(functools.partial(_triton_body, early=early), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(w.shape[0],),
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                          name="link")(x, w)


def link_for(variant: str, interpret: bool = False):
    if variant in ("triton", "triton_early"):
        return functools.partial(triton_link, early=variant == "triton_early", interpret=interpret)
    if variant in ("mosaic", "mosaic_pdl"):
        return functools.partial(mosaic_link, pdl=variant == "mosaic_pdl")
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--kernels", type=int, default=200, help="links in the chain (a step's kernels)")
    parser.add_argument("--programs", type=int, default=18, help="programs a link (a 576-wide output in 32s: 18)")
    parser.add_argument("--rows", type=int, default=72, help="weight rows of 256 a program reads (72: 36 KB)")
    parser.add_argument("--steps", type=int, default=32, help="chains in one timed device loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((args.programs, args.rows, WIDTH)), jnp.bfloat16)
               for _ in range(args.kernels)]
    x0 = jnp.asarray(rng.standard_normal(args.programs * LANES), jnp.float32)
    common = dict(benchmark="pdl_chain", device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  kernels=args.kernels, programs=args.programs, weight_bytes_per_program=args.rows * WIDTH * 2,
                  steps=args.steps, xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows = []
    print(f"{'variant':<12} {'us a kernel':>12} {'max |error|':>12}")
    for variant in [value.strip() for value in args.variants.split(",") if value.strip()]:
        try:
            link = link_for(variant, interpret)
            first = jax.jit(link)(x0, weights[0])
            error = float(jnp.max(jnp.abs(first - reference(x0, weights[0]))))

            @jax.jit
            def run(x, weights):
                def chain(_, x):
                    for w in weights:
                        x = link(x, w)
                    return x * 1e-3  # keeps the values bounded over the steps
                return lax.fori_loop(0, args.steps, chain, x)

            jax.block_until_ready(run(x0, weights))  # compiles
            best = float("inf")
            for _ in range(args.repeats):
                began = time.perf_counter()
                jax.block_until_ready(run(x0, weights))
                best = min(best, time.perf_counter() - began)
            row = dict(common, variant=variant, us_per_kernel=best / (args.steps * args.kernels) * 1e6,
                       max_abs_error=error)
            print(f"{variant:<12} {row['us_per_kernel']:>12.3f} {error:>12.2e}", flush=True)
        except Exception as error:  # a variant this backend cannot run is a row too
            row = dict(common, variant=variant, error=f"{type(error).__name__}: {error}"[:400])
            print(f"{variant:<12} {row['error'][:100]}", flush=True)
        rows.append(row)
    if args.out:
        append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
