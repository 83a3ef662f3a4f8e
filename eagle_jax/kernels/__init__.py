"""Hand-written kernels for the hot paths XLA splits into many small launches.

`fused_linear`: RMSNorm, matmul, SwiGLU and residual add fused for decode steps (few rows).
Each public function takes `implementation`: "xla" (plain jnp, the reference) or "pallas".
"""
