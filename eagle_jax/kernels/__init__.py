"""Hand-written kernels for the hot paths XLA splits into many small launches.

`fused_linear`: RMSNorm, matmul, SwiGLU and residual add fused for decode steps (few rows).
`decode_attention`: rotary, KV cache write and grouped attention of a decode step in one kernel.
Each public function takes `implementation`: "xla" (plain jnp, the reference) or "pallas".
"""
