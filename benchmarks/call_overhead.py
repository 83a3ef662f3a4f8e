"""What a device call costs apart from its steps: its buffers, its loop, its return to the host.

    python benchmarks/call_overhead.py --out docs/results/call_overhead.json

A serving host loop calls one compiled program per round: parameters (SmolLM2's target alone is
272 arrays) and a donated state go in, a device `while_loop` runs up to N steps, the host waits
for it. This times that shape with nothing else in it: M parameter buffers and S state buffers of
a few floats, each step a chain of --kernels tiny dependent kernels, for steps a call in --steps.
The time a call is `a + b * steps`; a (the call's own cost) against M + S says what a buffer costs
a call, and against the kernels a step what a longer loop body (more commands for XLA to record
in its CUDA graphs) costs a call. Prints a
table; --out appends JSON rows.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file

import jax
import jax.numpy as jnp
from jax import lax

from results_file import append_rows


def pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in pair.split(":")) for pair in text.split(",") if pair.strip()]


def program(kernels: int):
    """A jitted loop of `steps` (traced) steps over a donated state, `kernels` dependent kernels a
    step (an optimization barrier between each two keeps XLA from fusing them)."""
    def run(params, state, steps):
        bias = sum(params)  # every parameter is read, once a call

        def body(carry):
            step, state = carry
            first = state[0]
            for _ in range(kernels):
                first = lax.optimization_barrier(first * 0.999 + bias)
            return step + 1, [first] + [leaf + bias for leaf in state[1:]]
        return lax.while_loop(lambda carry: carry[0] < steps, body, (jnp.int32(0), state))[1]
    return jax.jit(run, donate_argnums=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", default="1:1,32:32,272:80,400:150", help="comma list of PARAMS:STATE buffer counts")
    parser.add_argument("--steps", default="1,16,64", help="comma list: steps a call")
    parser.add_argument("--kernels", default="1,200", help="comma list: dependent kernels a step (a decode step: ~200)")
    parser.add_argument("--calls", type=int, default=50, help="calls timed per setting (best of 3)")
    parser.add_argument("--out", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    steps_list = [int(s) for s in args.steps.split(",")]
    rows = []
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"{'params':>7} {'state':>6} {'kernels':>7} " + " ".join(f"{s:>4} steps" for s in steps_list) + "  (us a call)")
    settings = [(p, s, k) for p, s in pairs(args.buffers) for k in (int(k) for k in args.kernels.split(","))]
    for num_params, num_state, kernels in settings:
        params = [jnp.full((8,), 1e-3 * i, jnp.float32) for i in range(num_params)]
        state = [jnp.zeros((8,), jnp.float32) for _ in range(num_state)]
        run = program(kernels)
        times = []
        for steps in steps_list:
            state = run(params, state, jnp.int32(steps))  # compiles (once) and warms up
            jax.block_until_ready(state)
            best = float("inf")
            for _ in range(3):
                began = time.perf_counter()
                for _ in range(args.calls):
                    state = run(params, state, jnp.int32(steps))
                    jax.block_until_ready(state)  # a host loop reads each call's result
                best = min(best, (time.perf_counter() - began) / args.calls)
            times.append(best * 1e6)
            rows.append(dict(benchmark="call_overhead", device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                             date=date, params=num_params, state=num_state, kernels=kernels, steps=steps, us_per_call=best * 1e6,
                             command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])))
        print(f"{num_params:>7} {num_state:>6} {kernels:>7} " + " ".join(f"{t:>10.1f}" for t in times), flush=True)
    if args.out:
        append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
