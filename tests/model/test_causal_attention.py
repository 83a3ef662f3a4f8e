"""The training attention paths agree with the einsum reference they replace.

`causal_attention.causal_attention` is what the train step runs: the target's cache-free forward
and the head's training-time test (causal keys plus each query's own earlier draft steps). The cuDNN
variant needs a GPU; its block mask and odd-length padding are checked here through the same
`jax.nn.dot_product_attention` call with JAX's XLA implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model import causal_attention
from eagle_jax.model import config as config_lib
from eagle_jax.model import llama


def _qkv(length, extras, seed=0, batch=2, heads=4, kv_heads=2, dim=16):
    keys = jax.random.split(jax.random.key(seed), 3 + 2 * extras)
    q = jax.random.normal(keys[0], (batch, length, heads, dim))
    k, v = (jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[1:3])
    extra_k = tuple(jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[3:3 + extras])
    extra_v = tuple(jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[3 + extras:])
    return q, k, v, extra_k, extra_v


def _loop_reference(q, k, v, extra_k, extra_v):
    """Query t attends keys 0..t and extras[j][t], written out one query at a time."""
    batch, length, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape, np.float32)
    for b in range(batch):
        for t in range(length):
            for n in range(heads):
                kv = n // group
                keys = np.concatenate([np.asarray(k[b, :t + 1, kv])] + [np.asarray(e[b, t:t + 1, kv]) for e in extra_k])
                values = np.concatenate([np.asarray(v[b, :t + 1, kv])] + [np.asarray(e[b, t:t + 1, kv]) for e in extra_v])
                scores = keys @ np.asarray(q[b, t, n]) / np.sqrt(dim)
                probs = np.exp(scores - scores.max())
                out[b, t, n] = (probs / probs.sum()) @ values
    return out


@pytest.mark.parametrize("length,extras", [(5, 0), (6, 2), (7, 3)])
def test_xla_causal_attention_matches_a_per_query_loop(length, extras):
    q, k, v, extra_k, extra_v = _qkv(length, extras)
    out = causal_attention.causal_attention(q, k, v, "xla", extra_k, extra_v)
    np.testing.assert_allclose(out, _loop_reference(q, k, v, extra_k, extra_v), atol=1e-5)


@pytest.mark.parametrize("length,extras", [(6, 1), (7, 3)])  # 7: the odd length is padded to 8
def test_block_mask_call_matches_the_reference(length, extras):
    q, k, v, extra_k, extra_v = _qkv(length, extras, seed=1)
    fused = causal_attention._masked_attention_with_extras(q, k, v, extra_k, extra_v, implementation="xla")
    np.testing.assert_allclose(fused, causal_attention.causal_attention(q, k, v, "xla", extra_k, extra_v), atol=1e-5)


def test_unknown_implementation_is_an_error():
    q, k, v, _, _ = _qkv(4, 0)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        causal_attention.causal_attention(q, k, v, "flash")


def test_cache_free_forward_equals_the_cached_prefill():
    cfg = config_lib.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=8)
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    cached, _, captured_cached = model(tokens, positions, model.init_cache(2, 16), (0, 1))
    free, cache, captured_free = model(tokens, positions, None, (0, 1))
    assert cache is None
    np.testing.assert_allclose(free, cached, atol=1e-5)
    np.testing.assert_allclose(captured_free, captured_cached, atol=1e-5)
