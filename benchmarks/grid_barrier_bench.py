"""The grid barrier of the persistent kernels: whether it holds on this GPU, and what one costs.

    python benchmarks/grid_barrier_bench.py --programs 2,8,32,132 --rounds 1000 --out docs/results/barrier.json
    python benchmarks/grid_barrier_bench.py --programs 132 --spin volatile,atomic

`kernels.grid_barrier.check` on each grid and way of polling (--spin, `grid_barrier.wait`): every program stores its values, meets the others at a
barrier, reads its neighbour's, meets them again, --rounds times in one launch. A row per grid and spin:
the values read that were not the neighbour's (zero where the barrier holds) and microseconds a
barrier (the launch's best time over 2 x --rounds barriers, stores and loads included, best of
--repeats). Prints a table; --out appends JSON rows.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file

import jax

from eagle_jax.kernels import grid_barrier
from results_file import append_rows, error_field
from timing import best_seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="", help="comma list: grid sizes (default: the GPU's SMs)")
    parser.add_argument("--rounds", type=int, default=1000, help="store, barrier, load, barrier rounds a launch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spin", default="volatile", help=f"comma list of {', '.join(grid_barrier.SPINS)}")
    parser.add_argument("--out", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    grids = [int(value) for value in args.programs.split(",") if value.strip()] or [grid_barrier.resident_programs()]
    common = dict(benchmark="grid_barrier", device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  rounds=args.rounds)
    rows = []
    print(f"{'programs':>8} {'spin':>9} {'wrong values':>13} {'us a barrier':>13}")
    for programs in grids:
        for spin in [value.strip() for value in args.spin.split(",") if value.strip()]:
            check = lambda: grid_barrier.check(programs, args.rounds, spin=spin)
            try:
                mismatches = jax.block_until_ready(check())  # compiles
                best = best_seconds(check, args.repeats)
                row = dict(common, programs=programs, spin=spin, wrong_values=int(mismatches.sum()),
                           programs_that_saw_wrong_values=int((mismatches > 0).sum()),
                           us_per_barrier=best / (2 * args.rounds) * 1e6)
                print(f"{programs:>8} {spin:>9} {row['wrong_values']:>13} {row['us_per_barrier']:>13.2f}", flush=True)
            except Exception as error:  # a grid the GPU refuses is a row too
                row = dict(common, programs=programs, spin=spin, error=error_field(error))
                print(f"{programs:>8} {spin:>9} {row['error'][:100]}", flush=True)
            rows.append(row)
    if args.out:
        append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
