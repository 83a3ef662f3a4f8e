"""The grid barrier's check kernel (Pallas interpret mode, CPU): it counts what a missing barrier
lets through, and it lowers for CUDA to Triton, where it runs for real."""

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.kernels import grid_barrier


def test_one_program_reads_back_every_value_it_stored():
    mismatches = grid_barrier.check(1, rounds=5, interpret=True)
    assert mismatches.shape == (1,) and int(mismatches[0]) == 0


def test_without_the_barrier_a_program_reads_what_its_neighbour_has_not_stored(monkeypatch):
    """Interpret mode runs program 0 to its end before program 1 starts: with the barrier gone,
    program 0 reads its neighbour's values before they exist, and the check counts them."""
    monkeypatch.setattr(grid_barrier, "wait", lambda *args, **kwargs: None)
    run = grid_barrier._check.__wrapped__  # traced anew, with the barrier left out
    mismatches = run(jnp.zeros((1,), jnp.int32), programs=2, rounds=3, interpret=True)
    assert int(mismatches[0]) == 3 * grid_barrier.WIDTH  # every value of every round
    # Program 1 runs after program 0 has stored its last round: it finds that round's values in each.
    assert int(mismatches[1]) == 2 * grid_barrier.WIDTH


def test_refuses_more_programs_than_run_at_once():
    with pytest.raises(ValueError, match="programs must be in 1..1"):
        grid_barrier.check(2, rounds=1, interpret=True)


@pytest.mark.parametrize("spin, poll", [("volatile", "isVolatile = true"), ("atomic", "tt.atomic_rmw add")])
def test_lowers_to_triton_for_a_gpu_with_its_waits(capsys, spin, poll):
    """Lowered for CUDA on an H100's 132 programs, off a GPU: Pallas's Triton lowering runs here, and
    each of a round's two barriers keeps its spin (a while loop polling the counter, with volatile
    loads or atomics; tracing drops a loop of loads as dead code when nothing uses its result).
    Either way a wait has two atomics: the arrival and, for volatile polls, the acquire after them."""
    call = lambda counter: grid_barrier._check(counter, programs=132, rounds=4, interpret=False, debug=True, spin=spin)
    lowered = jax.jit(call).trace(jax.ShapeDtypeStruct((1,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
    module = capsys.readouterr().out
    module = module[module.index("The Triton module"):]
    spins = module.split("scf.while")[1:]
    assert len(spins) == 2  # the round's loop is an scf.for; each wait's spin an scf.while
    assert all(poll in spin_.split("scf.yield")[0] for spin_ in spins)
    assert module.count("tt.atomic_rmw add, acq_rel, gpu") == 4


def test_atomic_polls_check_in_interpret_mode():
    assert int(grid_barrier.check(1, rounds=3, interpret=True, spin="atomic")[0]) == 0
    with pytest.raises(ValueError, match="spin must be one of"):
        grid_barrier.check(1, rounds=1, interpret=True, spin="busy")
