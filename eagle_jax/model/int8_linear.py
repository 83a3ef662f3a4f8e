"""A bias-free output layer holding int8 weights and one float32 scale an output column.

Why: a draft reads its head's whole lm_head for one row ([576, 32,768] for the shipped EAGLE-3
head: 38 MB in bfloat16), the widest read of a draft. The package stores that weight as int8 with a
scale a column (`io.int8_weights`); run as stored, a draft reads half the bytes. The logits are the
float32 sums of the input times the int8 values (int8 widens to bfloat16 exactly), each column
then scaled: the stored weight's own product, with no rounding of the widened weight to 16 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Int8Linear(nnx.Module):
    """x [..., K] -> float32 [..., N]: (x @ kernel) * scale, kernel int8 [K, N], scale float32 [N].

    It stands where an `nnx.Linear` without bias stands for the fused kernels' checks
    (`use_bias`, `dtype`: the dtype it computes in, its input's). Inference only: the int8
    values are not trained.
    """

    use_bias = False

    def __init__(self, kernel: jax.Array, scale: jax.Array, dtype):
        if kernel.dtype != jnp.int8 or kernel.ndim != 2:
            raise ValueError(f"an int8 layer holds an int8 [in, out] kernel, got {kernel.dtype} {kernel.shape}")
        if scale.shape != kernel.shape[1:]:
            raise ValueError(f"one scale an output column: kernel {kernel.shape}, scale {scale.shape}")
        self.kernel = nnx.Param(kernel)
        self.scale = nnx.Param(scale.astype(jnp.float32))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = jnp.einsum("...k,kn->...n", x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return logits * self.scale[...]
