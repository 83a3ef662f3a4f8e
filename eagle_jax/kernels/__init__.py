"""Hand-written kernels for the hot paths XLA splits into many small launches.

`fused_linear`: RMSNorm, matmul, SwiGLU and residual add fused for decode steps (few rows).
`decode_attention`: rotary, KV cache write and grouped attention of a decode step in one kernel.
`compact_cache`: a tree verify's accepted path moved into place in every layer's cache at once.
Each public function takes `implementation`: "xla" (plain jnp, the reference) or "pallas".
"""
