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
values of the vector. Then links that are a decoder's projections, x @ W with W [--width, --width]
bfloat16 (each link its own):

  * fused: our Pallas Triton `fused_linear.linear_residual` at one row (x + x @ W), as the
    decode step runs o_proj
  * mma, mma_pdl: a Pallas Mosaic GPU kernel that keeps the one row replicated over the 64 rows of a
    tensor-core tile: each program copies its [width, 64] column strip of W and the [64, width]
    activations to shared memory (TMA), multiplies them with `wgmma` and writes its [64, 64] block,
    which the next link reads as its activations; mma_pdl as mosaic_pdl (the strip's copy issued
    before the wait)

Every link is checked against jnp on the first call. Prints us a kernel (the loop's wall time over
steps x kernels, best of --repeats, with each chain's one rescaling of the values); --out appends
JSON rows.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmg
from jax.experimental.pallas import triton as pltr

from eagle_jax.kernels import fused_linear
from results_file import append_rows, error_field
from timing import best_seconds

WIDTH = 256  # a weight slab's row: one TMA box wide
LANES = 128  # values of the vector a program writes: one warpgroup's
VARIANTS = ("triton", "triton_early", "mosaic", "mosaic_pdl", "fused", "mma", "mma_pdl")
LINEAR_VARIANTS = ("fused", "mma", "mma_pdl")
TILE = 64  # a tensor-core tile's rows, a program's output columns and a K chunk in the mma links
SWIZZLED = (plmg.TilingTransform((8, TILE)), plmg.SwizzleTransform(128))  # bfloat16 wgmma operands


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
    # Triton's blocks are powers of two: the slab's rows and the vector padded, masked.
    row_index, vector_index = jnp.arange(pl.next_power_of_2(rows)), jnp.arange(pl.next_power_of_2(x_ref.shape[0]))
    weights = pltr.load(w_ref.at[program, row_index[:, None], jnp.arange(width)[None, :]],
                        mask=(row_index < rows)[:, None], other=0)
    total = jnp.sum(pltr.load(x_ref.at[vector_index], mask=vector_index < x_ref.shape[0], other=0))
    mine = program * LANES + lanes
    extra = total * 1e-3 + jnp.sum(weights.astype(jnp.float32)) * 1e-6
    pltr.store(y_ref.at[mine], pltr.load(x_ref.at[mine]) * 0.5 + extra)


def triton_link(x: jax.Array, w: jax.Array, early: bool = False, interpret: bool = False) -> jax.Array:
    return pl.pallas_call(functools.partial(_triton_body, early=early), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(w.shape[0],), compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                          name="link")(x, w)


def _mma_body(act_ref, w_ref, out_ref, a_smem, b_smem, o_smem, barriers, *, pdl: bool):
    program = lax.axis_index("programs")
    chunks = a_smem.shape[0]
    if pdl:
        plmg.griddepcontrol_launch_dependents()
    for chunk in range(chunks):  # the weights' column strip: no kernel writes it
        plmg.copy_gmem_to_smem(w_ref.at[pl.ds(chunk * TILE, TILE), pl.ds(program * TILE, TILE)], b_smem.at[chunk],
                               barriers.at[chunk])
    if pdl:
        plmg.griddepcontrol_wait()
    for chunk in range(chunks):
        plmg.copy_gmem_to_smem(act_ref.at[:, pl.ds(chunk * TILE, TILE)], a_smem.at[chunk], barriers.at[chunks + chunk])
    for barrier in range(2 * chunks):
        plmg.barrier_wait(barriers.at[barrier])

    def multiply(acc_ref):
        for chunk in range(chunks):
            plmg.wgmma(acc_ref, a_smem.at[chunk], b_smem.at[chunk])
        plmg.wgmma_wait(0)
        return acc_ref[...]

    o_smem[...] = pl.run_scoped(multiply, plmg.ACC((TILE, TILE), jnp.float32)).astype(o_smem.dtype)
    plmg.commit_smem()
    plmg.copy_smem_to_gmem(o_smem, out_ref.at[:, pl.ds(program * TILE, TILE)])
    plmg.wait_smem_to_gmem(0)


def mma_link(act: jax.Array, w: jax.Array, pdl: bool) -> jax.Array:
    """act [64, K] @ w [K, N] in bfloat16 (K, N multiples of 64), one program a 64-column strip."""
    (rows, width), out = act.shape, w.shape[1]
    chunks = width // TILE
    return plmg.kernel(functools.partial(_mma_body, pdl=pdl), out_type=jax.ShapeDtypeStruct((rows, out), act.dtype),
                       grid=(out // TILE,), grid_names=("programs",),
                       scratch_types=[plmg.SMEM((chunks, TILE, TILE), act.dtype, transforms=SWIZZLED),
                                      plmg.SMEM((chunks, TILE, TILE), w.dtype, transforms=SWIZZLED),
                                      plmg.SMEM((TILE, TILE), act.dtype, transforms=SWIZZLED),
                                      plmg.Barrier(num_barriers=2 * chunks)])(act, w)


def fused_link(x: jax.Array, w: jax.Array, interpret: bool = False) -> jax.Array:
    return fused_linear.linear_residual(x, w, x, implementation="pallas", interpret=interpret)


def link_for(variant: str, interpret: bool = False):
    if variant == "fused":
        return functools.partial(fused_link, interpret=interpret)
    if variant in ("mma", "mma_pdl"):
        return functools.partial(mma_link, pdl=variant == "mma_pdl")
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
    parser.add_argument("--width", type=int, default=576, help="the linear links' K = N (a multiple of 64)")
    parser.add_argument("--steps", type=int, default=32, help="chains in one timed device loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    slabs = [jnp.asarray(rng.standard_normal((args.programs, args.rows, WIDTH)), jnp.bfloat16)
             for _ in range(args.kernels)]
    x0_sum = jnp.asarray(rng.standard_normal(args.programs * LANES), jnp.float32)
    # The linear links keep the activations' scale: W ~ N(0, 1 / K), the sum's scale that of x.
    matrices = [jnp.asarray(rng.standard_normal((args.width, args.width)) / np.sqrt(args.width), jnp.bfloat16)
                for _ in range(args.kernels)]
    rows0 = jnp.asarray(rng.standard_normal(args.width), jnp.bfloat16)
    inputs = dict(fused=(rows0[None], matrices), mma=(jnp.broadcast_to(rows0, (TILE, args.width)), matrices))
    inputs["mma_pdl"] = inputs["mma"]
    common = dict(benchmark="pdl_chain", device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  kernels=args.kernels, programs=args.programs, weight_bytes_per_program=args.rows * WIDTH * 2,
                  width=args.width,
                  steps=args.steps, xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows = []
    print(f"{'variant':<12} {'us a kernel':>12} {'max |error|':>12}")
    for variant in [value.strip() for value in args.variants.split(",") if value.strip()]:
        try:
            link = link_for(variant, interpret)
            x0, weights = inputs.get(variant, (x0_sum, slabs))
            first = jax.jit(link)(x0, weights[0])
            if variant in LINEAR_VARIANTS:
                want = (x0.astype(jnp.float32) @ weights[0].astype(jnp.float32))
                want = want + x0.astype(jnp.float32) if variant == "fused" else want
            else:
                want = reference(x0, weights[0])
            error = float(jnp.max(jnp.abs(first.astype(jnp.float32) - want)))
            largest = float(jnp.max(jnp.abs(want)))

            @jax.jit
            def run(x, weights):
                def chain(_, x):
                    for w in weights:
                        x = link(x, w)
                    scale = 1.0 / (1.0 + jnp.max(jnp.abs(x.astype(jnp.float32))))  # bounded over the steps
                    return (x * scale).astype(x.dtype)
                return lax.fori_loop(0, args.steps, chain, x)

            jax.block_until_ready(run(x0, weights))  # compiles
            best = best_seconds(lambda: run(x0, weights), args.repeats)
            row = dict(common, variant=variant, us_per_kernel=best / (args.steps * args.kernels) * 1e6,
                       max_abs_error=error, reference_max_abs=largest)
            print(f"{variant:<12} {row['us_per_kernel']:>12.3f} {error:>12.2e}", flush=True)
        except Exception as error:  # a variant this backend cannot run is a row too
            row = dict(common, variant=variant, error=error_field(error))
            print(f"{variant:<12} {row['error'][:100]}", flush=True)
        rows.append(row)
    if args.out:
        append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
