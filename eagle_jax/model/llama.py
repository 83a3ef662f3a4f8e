"""The Llama target model (HF `LlamaForCausalLM` layout) as a Flax NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.model import config as config_lib
from eagle_jax.model import float32_logits
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers


class Llama(nnx.Module):
    """Embeddings, decoder layers, final norm and (tied or untied) lm_head.

    Layers are unrolled in Python rather than scanned: on GPU a scanned layer loop is not
    captured into one command buffer and costs ~1.6x per decode step (docs/DESIGN notes);
    compile time stays a few seconds at 30 layers.
    """

    def __init__(self, cfg: config_lib.LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.config = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, **kw)
        self.layers = nnx.List([layers.DecoderLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_layers)])
        self.norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs, **kw)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: kv_cache_lib.KVCache | None,
                 capture_layers: tuple[int, ...] = (), implementation: str = "xla",
                 mask: layers.SlotMask | None = None, attend_length: int | None = None,
                 kernels: layers.Kernels = layers.XLA):
        """Runs T tokens per row, writing their keys and values at `positions`.

        Args:
            tokens: [B, T] int32 token ids.
            positions: [B, T] int32 positions (contiguous per row; also the cache slots).
            cache: the KV cache; `cache.lengths` is left for the caller to advance. None runs
                causal self-attention among the T tokens without a cache (training features),
                with `implementation` "xla" or "cudnn" (`causal_attention.causal_attention`).
            capture_layers: layer indices whose *inputs* (the residual stream) are returned,
                concatenated, for EAGLE-3 features.
            mask: cache slots and visibility when positions are not slots (tree verification).
            attend_length: attention reads only cache slots below it (`layers.Attention`).
            kernels: the kernels of cached calls (`layers.Kernels`; static).

        Returns:
            (hidden [B, T, D] after the final norm, updated cache, captured [B, T, C*D] or None).
        """
        x = self.embed_tokens(tokens)
        num_layers = len(self.layers)
        keys, values = (list(cache.keys), list(cache.values)) if cache is not None else ([None] * num_layers,) * 2
        captured = {}
        for index, layer in enumerate(self.layers):
            if index in capture_layers:
                captured[index] = layers.summed(x)
            # pending: on the fused kernels a layer hands its down_proj's partial sums to the next
            # layer's first kernel to add (`layers.PendingResidual`).
            x, keys[index], values[index] = layer(x, positions, keys[index], values[index], implementation, mask,
                                                  attend_length, kernels, pending=True)
        if cache is not None:
            cache = cache.replace(keys=tuple(keys), values=tuple(values))
        # In the requested order, repeats allowed (tiny targets give EAGLE-3 defaults like (2, 2, 1)).
        features = jnp.concatenate([captured[i] for i in capture_layers], axis=-1) if capture_layers else None
        return self.norm(layers.summed(x)), cache, features

    def output_embedding(self) -> jax.Array:
        """[V, D]: row t scores token t (the lm_head, or the input embedding when tied)."""
        return self.embed_tokens.embedding[...] if self.config.tie_word_embeddings else self.lm_head.kernel[...].T

    def logits(self, hidden: jax.Array, vocab_ids: jax.Array | None = None) -> jax.Array:
        """float32 logits [..., V] from final-norm hidden states; [..., len(vocab_ids)] for a subset."""
        weight = self.output_embedding()
        if vocab_ids is not None:  # gather rows first: a slice of the product costs the full product
            weight = jnp.take(weight, vocab_ids, axis=0)
        return float32_logits.float32_logits(hidden, weight.T)

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> kv_cache_lib.KVCache:
        cfg = self.config
        dtype = dtype or self.embed_tokens.embedding[...].dtype
        return kv_cache_lib.KVCache.create(cfg.num_layers, batch_size, max_length, cfg.num_kv_heads, cfg.head_dim, dtype)
