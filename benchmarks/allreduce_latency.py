"""Time one small all-reduce across the local GPUs, the collective a tensor-parallel decode step
runs twice a layer.

    python benchmarks/allreduce_latency.py --sizes 4096,576 --out docs/results/profile_h200.json

At batch 1 a Megatron layer all-reduces one [1, hidden] bf16 row after o_proj and another after
down_proj, so a 32-layer step runs 65 of them back to back. On two H200s on 2026-11-30 (commit
f96b584, `benchmarks/scale_8b.py --tensor_parallel_size 1,2`) the Llama-3.1-8B-shaped decode
step took 7.65 ms at TP 2 against 6.17 ms at TP 1: if the split halved the weight reads, ~4.5 ms
went to collectives, ~70 µs each, far above NVLink latencies (~10-20 µs). So this script
measures the collective alone, N all-reduces chained inside one jitted program (each depends on
the previous, as in the model), and records µs per all-reduce. `--chain unrolled` writes the N
all-reduces out, as the model's unrolled layers do; `--chain loop` runs them in a
`lax.fori_loop`, whose every iteration also pays the loop's own cost on XLA:GPU (the condition
is read back by the host), so the difference between the two measures that cost too. Run it
with NCCL_DEBUG=INFO to see which transport NCCL chose (P2P/NVLink, SHM through the host, or
sockets); `nvidia-smi topo -m` shows how the GPUs are linked.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
from jax.sharding import NamedSharding, PartitionSpec

from eagle_jax.serve import sharding
from results_file import append_rows


def chained_all_reduces(mesh, width: int, count: int, dtype, chain: str = "loop"):
    """A jitted fn(x [P, width]) running `count` dependent all-reduces of each device's [1, width]
    row, in a fori_loop (chain "loop") or written out (chain "unrolled")."""
    spec = PartitionSpec(sharding.TENSOR, None)

    # check_vma off: psum's result is the same on every device, which the carry's type would otherwise
    # have to say; the loop only needs each all-reduce to wait for the previous one.
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    def body(x):
        def one(_, value):  # the scale keeps values finite; the psum is what is timed
            return jax.lax.psum(value, sharding.TENSOR) * jnp.asarray(0.5, dtype)
        if chain == "loop":
            return jax.lax.fori_loop(0, count, one, x)
        for index in range(count):
            x = one(index, x)
        return x

    return jax.jit(body), NamedSharding(mesh, spec)


def measure(mesh, width: int, count: int, iterations: int, dtype, chain: str = "loop") -> float:
    """Seconds per all-reduce: median over `iterations` calls of `count` chained all-reduces."""
    fn, placement = chained_all_reduces(mesh, width, count, dtype, chain)
    size = mesh.shape[sharding.TENSOR]
    x = jax.device_put(jnp.ones((size, width), dtype), placement)
    fn(x).block_until_ready()  # compile and warm up
    times = []
    for _ in range(iterations):
        began = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - began)
    return float(np.median(times)) / count


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--sizes", default="4096,576", help="row widths (hidden sizes) to all-reduce, comma-separated")
    parser.add_argument("--count", type=int, default=64, help="chained all-reduces per call")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--chain", default="unrolled,loop", help="comma-separated: unrolled, loop (docstring)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="results JSON to append rows to (kind: all_reduce)")
    args = parser.parse_args(argv)
    mesh = sharding.make_mesh(args.tensor_parallel_size)
    dtype = jnp.dtype(args.dtype)
    rows = []
    for chain, width in ((c, int(w)) for c in args.chain.split(",") for w in args.sizes.split(",")):
        seconds = measure(mesh, width, args.count, args.iterations, dtype, chain)
        row = dict(kind="all_reduce", tensor_parallel_size=args.tensor_parallel_size, width=width, dtype=args.dtype,
                   chained=args.count, chain=chain, us_per_all_reduce=round(seconds * 1e6, 2), device=jax.devices()[0].device_kind,
                   platform=jax.default_backend(), jax_version=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS") or None,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python " + shlex.join(["benchmarks/allreduce_latency.py"] + sys.argv[1:]))
        print(f"[allreduce_latency] TP {args.tensor_parallel_size}, [1, {width}] {args.dtype}: "
              f"{row['us_per_all_reduce']} µs per all-reduce ({args.count} chained, {chain})")
        rows.append(row)
    if args.out:
        append_rows(args.out, rows)


if __name__ == "__main__":
    main()
