"""benchmarks/pdl_chain_bench.py off a GPU: the Triton link runs in interpret mode and matches jnp;
the Mosaic GPU links lower for CUDA, the PDL one with both grid dependency instructions."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from tests.benchmarks import script


def test_a_row_per_variant(tmp_path):
    bench = script("pdl_chain_bench")
    out = tmp_path / "rows.json"
    assert bench.main(["--kernels", "3", "--programs", "2", "--rows", "8", "--steps", "2", "--repeats", "1",
                       "--out", str(out)]) == 0
    triton, triton_early, mosaic, mosaic_pdl = json.loads(out.read_text())
    assert triton["variant"] == "triton" and triton["max_abs_error"] < 1e-5 and triton["us_per_kernel"] > 0
    assert "error" in triton_early  # interpret mode runs no inline asm
    for row in (mosaic, mosaic_pdl):  # Mosaic GPU kernels run on a GPU only
        assert "interpret mode" in row["error"]


@pytest.mark.parametrize("pdl", [False, True])
def test_mosaic_links_lower_for_a_gpu(pdl):
    bench = script("pdl_chain_bench")
    x = jax.ShapeDtypeStruct((18 * bench.LANES,), jnp.float32)
    w = jax.ShapeDtypeStruct((18, 72, bench.WIDTH), jnp.bfloat16)
    text = jax.jit(functools.partial(bench.mosaic_link, pdl=pdl)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    for instruction in ("griddepcontrol.launch_dependents;", "griddepcontrol.wait;"):
        assert (instruction in text) == pdl


def test_the_early_triton_link_keeps_its_launch_instruction(capsys):
    bench = script("pdl_chain_bench")
    x = jax.ShapeDtypeStruct((2 * bench.LANES,), jnp.float32)
    w = jax.ShapeDtypeStruct((2, 8, bench.WIDTH), jnp.bfloat16)
    call = lambda x, w: bench.pl.pallas_call(
        functools.partial(bench._triton_body, early=True), out_shape=x, grid=(2,), debug=True,
        compiler_params=bench.pltr.CompilerParams(num_warps=4, num_stages=1))(x, w)
    jax.jit(call).trace(x, w).lower(lowering_platforms=("cuda",))
    module = capsys.readouterr().out
    assert "tt.elementwise_inline_asm \"griddepcontrol.launch_dependents;" in module[module.index("The Triton module"):]
