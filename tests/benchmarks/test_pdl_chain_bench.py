"""benchmarks/pdl_chain_bench.py off a GPU: the Triton links run in interpret mode and match jnp;
the Mosaic GPU links lower for CUDA, the PDL ones with both grid dependency instructions."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from tests.benchmarks import script


def test_a_row_per_variant(tmp_path):
    bench = script("pdl_chain_bench")
    out = tmp_path / "rows.json"
    assert bench.main(["--kernels", "3", "--programs", "2", "--rows", "8", "--width", "128", "--steps", "2",
                       "--repeats", "1", "--out", str(out)]) == 0
    triton, triton_early, mosaic, mosaic_pdl, fused, mma, mma_pdl = json.loads(out.read_text())
    assert triton["variant"] == "triton" and triton["max_abs_error"] < 1e-5 and triton["us_per_kernel"] > 0
    assert fused["variant"] == "fused" and fused["us_per_kernel"] > 0
    assert fused["max_abs_error"] <= 2 ** -7 * fused["reference_max_abs"]  # one bfloat16 rounding
    assert "error" in triton_early  # interpret mode runs no inline asm
    for row in (mosaic, mosaic_pdl, mma, mma_pdl):  # Mosaic GPU kernels run on a GPU only
        assert "interpret mode" in row["error"]


@pytest.mark.parametrize("link", ["mosaic", "mma"])
@pytest.mark.parametrize("pdl", [False, True])
def test_mosaic_links_lower_for_a_gpu(pdl, link):
    bench = script("pdl_chain_bench")
    if link == "mosaic":
        call = bench.mosaic_link
        x = jax.ShapeDtypeStruct((18 * bench.LANES,), jnp.float32)
        w = jax.ShapeDtypeStruct((18, 72, bench.WIDTH), jnp.bfloat16)
    else:
        call = bench.mma_link
        x, w = jax.ShapeDtypeStruct((64, 576), jnp.bfloat16), jax.ShapeDtypeStruct((576, 576), jnp.bfloat16)
    text = jax.jit(functools.partial(call, pdl=pdl)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    for instruction in ("griddepcontrol.launch_dependents;", "griddepcontrol.wait;"):
        assert (instruction in text) == pdl


def test_the_early_triton_link_keeps_its_launch_instruction(capsys):
    """At the bench's default shapes (18 programs of 72 rows: not powers of two, which Triton's
    lowering refuses unless padded), lowered for CUDA."""
    bench = script("pdl_chain_bench")
    x = jax.ShapeDtypeStruct((18 * bench.LANES,), jnp.float32)
    w = jax.ShapeDtypeStruct((18, 72, bench.WIDTH), jnp.bfloat16)
    call = lambda x, w: bench.pl.pallas_call(
        functools.partial(bench._triton_body, early=True), out_shape=x, grid=(18,), debug=True,
        compiler_params=bench.pltr.CompilerParams(num_warps=4, num_stages=1))(x, w)
    jax.jit(call).trace(x, w).lower(lowering_platforms=("cuda",))
    module = capsys.readouterr().out
    assert "tt.elementwise_inline_asm \"griddepcontrol.launch_dependents;" in module[module.index("The Triton module"):]
