"""A grid-wide barrier for Pallas (Triton) kernels whose programs are all resident at once, and a
kernel that checks it on a GPU.

Each program adds one to a counter in global memory, then spins until the counter reaches the
barrier's index times the grid: barrier i of a launch opens once every program has arrived at it.
The counter starts at zero each launch (the caller passes a zeroed buffer, aliased to an output),
so a launch may hold any number of barriers with no reset between them. What a program stored
before a barrier, another reads after it with volatile loads (`shared_load`), past its SM's L1.

The programs must all be resident: more than the GPU runs at once would wait at the first barrier
forever. Pallas interpret mode runs programs one after another, so it runs one program, whose
barriers never wait.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

WIDTH = 64  # values each program writes a round in `check`: a vector store spread over the threads


def resident_programs() -> int:
    """Programs that run at once, one per SM of the default device (a GPU); else 1."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 1) if device.platform == "gpu" else 1


def grid(programs: int | None, interpret: bool) -> int:
    """The grid for `programs` (None: one per SM; interpret mode runs one program).

    Raises:
        ValueError: more programs than run at once (they would wait at the first barrier forever).
    """
    resident = 1 if interpret else resident_programs()
    programs = programs or resident
    if not 0 < programs <= resident:
        raise ValueError(f"programs must be in 1..{resident} (one a streaming multiprocessor), got {programs}")
    return programs


SPINS = ("volatile", "atomic")  # how `wait` polls the counter


def wait(counter_ref, index, programs: int, interpret: bool, spin: str = "volatile") -> None:
    """Waits until every one of `programs` programs has arrived here: the launch's `index`-th barrier (from 1).

    spin: "volatile" polls with volatile loads, then one atomic acquires (others' stores now
    visible); "atomic" polls with atomic adds of zero, each an acquire, so the acquire comes with
    the last poll, a round trip to L2 fewer, at the price of atomics on one address while it waits.
    """
    if spin not in SPINS:
        raise ValueError(f"spin must be one of {SPINS}, got {spin!r}")
    if not interpret:  # Pallas interpret mode has no CTA barrier (nor needs one)
        plgpu.debug_barrier()  # every thread's stores before this program's release
    add = lambda value: plgpu.atomic_add(counter_ref, (jnp.int32(0),), value)
    arrived = add(jnp.int32(1)) + 1
    target = index * programs
    # Interpret mode runs one program, which never polls, and cannot discharge an atomic inside a loop.
    if spin == "atomic" and not interpret:  # an atomic writes, so tracing keeps the loop whatever uses its result
        lax.while_loop(lambda seen: seen < target, lambda _: add(jnp.int32(0)), arrived)
    else:
        seen = lax.while_loop(lambda seen: seen < target,
                              lambda _: plgpu.load(counter_ref.at[jnp.int32(0)], volatile=True), arrived)
        # The acquire adds min(seen - target, 0): zero, since the wait is over, but it uses the spin's
        # result. Tracing drops a loop whose result nothing uses as dead code, volatile loads or not,
        # and no program would wait.
        add(jnp.minimum(seen - target, 0))
    if not interpret:
        plgpu.debug_barrier()


def shared_load(ref, index, mask, other=0.0):
    """A load of what other programs stored in this launch: volatile, so from L2, never a stale
    line of this SM's L1 (Pallas lowers no `.cg` cache modifier)."""
    return plgpu.load(ref.at[index], mask=mask, other=other, volatile=True)


def check(programs: int | None, rounds: int, interpret: bool | None = None, debug: bool = False,
          spin: str = "volatile") -> jax.Array:
    """Runs `rounds` rounds of: each program stores WIDTH values of its own, barrier, reads its
    neighbour's (program + 1, cyclically), barrier. Returns [programs] int32: the values each program
    read that were not what its neighbour stored that round (all zero where the barrier holds).

    Args:
        programs: the grid, all resident at once (`grid`: None is one program per SM).
        interpret: Pallas interpret mode; None: unless the default backend is a GPU.
        debug: print the kernel's jaxpr and, lowering for a GPU, its Triton module (`pl.pallas_call`'s flag).
        spin: how each barrier polls (`wait`).
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _check(jnp.zeros((1,), jnp.int32), programs=grid(programs, interpret), rounds=rounds, interpret=interpret,
                  debug=debug, spin=spin)


@functools.partial(jax.jit, static_argnames=("programs", "rounds", "interpret", "debug", "spin"))
def _check(counter, *, programs, rounds, interpret, debug=False, spin="volatile"):
    out_shape = (jax.ShapeDtypeStruct((1,), jnp.int32),  # the counter
                 jax.ShapeDtypeStruct((programs, WIDTH), jnp.int32),  # what each program stored last
                 jax.ShapeDtypeStruct((programs,), jnp.int32))  # mismatches a program saw
    _, _, mismatches = pl.pallas_call(
        functools.partial(_check_kernel, programs=programs, rounds=rounds, interpret=interpret, spin=spin),
        out_shape=out_shape, grid=(programs,), input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, debug=debug,
        name="grid_barrier_check",
    )(counter)
    return mismatches


def _check_kernel(_counter_in, counter_ref, stored_ref, mismatches_ref, *, programs, rounds, interpret, spin):
    program = pl.program_id(0)
    neighbour = lax.rem(program + 1, programs)
    lanes = jnp.arange(WIDTH)
    everywhere = lanes < WIDTH

    def value(round_, who):
        return (round_ * programs + who) * WIDTH + lanes

    def one_round(round_, mismatches):
        plgpu.store(stored_ref.at[program, lanes], value(round_, program))
        wait(counter_ref, 2 * round_ + 1, programs, interpret, spin)
        seen = shared_load(stored_ref, (neighbour, lanes), everywhere, 0)
        mismatches += jnp.sum((seen != value(round_, neighbour)).astype(jnp.int32))
        wait(counter_ref, 2 * round_ + 2, programs, interpret, spin)  # nobody stores the next round before all have read
        return mismatches

    mismatches = lax.fori_loop(0, rounds, one_round, jnp.int32(0))
    plgpu.store(mismatches_ref.at[program], mismatches)
