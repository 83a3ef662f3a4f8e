"""Int8 storage of a checkpoint's 2-D weights, one float32 scale per output row, undone at load.

Why: the shipped EAGLE-3 head's lm_head (32,768 x 576) is 38 MB in bfloat16, more than the rest
of the head together, and the package carries its heads. Stored as int8 it is half that. The
head runs the same program (the weights are widened back to the load dtype at load); only each
value moves, by at most half its row's step (absmax / 127). On MT-Bench that moved the replayed
acceptance length by +0.005 (the CPU replay of 2026-12-02,
docs/results/replay_int8_lm_head_cpu_2026-12-02.json), far less than repeated H200 measurements
of one head spread.

Layout, as compressed-tensors names it: `NAME` int8 [out, in] beside `NAME_scale` float32
[out, 1]. eagle_jax reads it; vLLM and SGLang do not (`eagle-jax-convert SRC DST --target T`
writes the head back in its own dtype, the plain layout).
"""

from __future__ import annotations

import numpy as np

from eagle_jax.io import hf_files

SCALE_SUFFIX = "_scale"


def quantize(tensors: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """`tensors` with each of `names` (2-D floating weights, [out, in]) stored as int8 + row scale.

    Raises:
        hf_files.CheckpointError: a name is missing, or not a 2-D floating weight.
    """
    tensors = dict(tensors)
    for name in names:
        if name not in tensors:
            raise hf_files.CheckpointError(f"no tensor {name!r} to store as int8 (have: {', '.join(sorted(tensors))})")
        weight = np.asarray(tensors[name])
        if weight.ndim != 2 or weight.dtype.kind not in "fV":  # bfloat16's numpy kind is "V"
            raise hf_files.CheckpointError(f"{name!r} is {weight.dtype} {weight.shape}: only 2-D floating weights "
                                           "are stored as int8")
        weight = weight.astype(np.float32)
        absmax = np.abs(weight).max(axis=1, keepdims=True)
        scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)  # an all-zero row stays zero
        tensors[name] = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        tensors[name + SCALE_SUFFIX] = scale
    return tensors


def dequantize(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with every int8 `NAME` that has a `NAME_scale` widened back to float32.

    Other tensors pass through untouched (a `_scale` without an int8 partner too: the conversion
    table then names it as a tensor it has no rule for). With nothing stored as int8, `tensors`
    itself comes back, so a caller can tell (`eagle-jax-convert` then keeps the head's dtypes).
    """
    quantized = [name for name in tensors
                 if name + SCALE_SUFFIX in tensors and np.asarray(tensors[name]).dtype == np.int8]
    if not quantized:
        return tensors
    tensors = dict(tensors)
    for name in quantized:
        scale = np.asarray(tensors.pop(name + SCALE_SUFFIX), np.float32)
        weight = np.asarray(tensors[name])
        if scale.shape not in ((weight.shape[0], 1), (weight.shape[0],)):
            raise hf_files.CheckpointError(f"{name + SCALE_SUFFIX!r} has shape {scale.shape}, expected "
                                           f"({weight.shape[0]}, 1): one scale per row of {name!r} {weight.shape}")
        tensors[name] = weight.astype(np.float32) * scale.reshape(-1, 1)
    return tensors
