"""EAGLE-1 and EAGLE-3 draft heads.

Both heads share one interface, so the speculative loop does not care which it runs:
  * `project(target_features)`: target features -> the head's feature space [.., D].
  * `__call__(tokens, features, positions, cache, target)`: one draft forward; returns
    (next features [B, T, D], logits [B, T, V_draft], cache).
  * `to_target_ids(draft_ids)`: draft vocabulary -> target vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax import config as config_lib
from eagle_jax import kv_cache as kv_cache_lib
from eagle_jax import layers
from eagle_jax import llama


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """A draft head: its one-layer Llama config plus what is specific to the EAGLE kind."""

    method: str  # "eagle" (EAGLE-1) or "eagle3"
    layer: config_lib.LlamaConfig
    fc_bias: bool = False  # EAGLE-1 only
    draft_vocab_size: int = 0  # EAGLE-3 only
    target_hidden_size: int = 0  # EAGLE-3: width of each captured target feature
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose inputs are captured

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default capture points: inputs of layers 2, L//2 and L-3 (as vLLM and SpecForge)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle1Head(nnx.Module):
    """x = fc([embed(t); f]); h = x + Attn(x); out = h + MLP(norm(h)); logits = target lm_head(out)."""

    def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.config = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        hidden = cfg.hidden_size
        self.fc = nnx.Linear(2 * hidden, hidden, use_bias=cfg.fc_bias, rngs=rngs, **kw)
        self.self_attn = layers.Attention(cfg.layer, rngs=rngs, **kw)
        self.post_attention_layernorm = layers.RMSNorm(hidden, cfg.layer.rms_norm_eps, **kw)
        self.mlp = layers.MLP(cfg.layer, rngs=rngs, **kw)

    def project(self, target_features: jax.Array) -> jax.Array:
        return target_features  # EAGLE-1 regresses the target's final-norm hidden state itself

    def __call__(self, tokens, features, positions, cache: kv_cache_lib.KVCache, target: llama.Llama):
        embedded = target.embed_tokens(tokens)
        x = self.fc(jnp.concatenate([embedded, features.astype(embedded.dtype)], axis=-1))
        attended, keys, values = self.self_attn(x, positions, cache.keys[0], cache.values[0])  # no input norm
        h = x + attended
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, target.logits(out), cache.replace(keys=(keys,), values=(values,))

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids


class Eagle3Head(nnx.Module):
    """EAGLE-3 midlayer over concat(input_layernorm(embed), hidden_norm(g)), own norm and lm_head."""

    def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.config = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        hidden, eps = cfg.hidden_size, cfg.layer.rms_norm_eps
        num_features = len(cfg.feature_layers)
        self.fc = nnx.Linear(num_features * cfg.target_hidden_size, hidden, use_bias=False, rngs=rngs, **kw)
        self.midlayer = Eagle3Midlayer(cfg, rngs=rngs, **kw)
        self.norm = layers.RMSNorm(hidden, eps, **kw)
        self.lm_head = nnx.Linear(hidden, cfg.draft_vocab_size, use_bias=False, rngs=rngs, **kw)
        # d2t[i] = target_id - draft_id; a Param-free variable so it travels with the weights.
        self.d2t = nnx.Variable(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    def project(self, target_features: jax.Array) -> jax.Array:
        return self.fc(target_features.astype(self.fc.kernel.value.dtype))

    def __call__(self, tokens, features, positions, cache: kv_cache_lib.KVCache, target: llama.Llama):
        embedded = target.embed_tokens(tokens)
        pre, keys, values = self.midlayer(embedded, features, positions, cache.keys[0], cache.values[0])
        logits = jnp.einsum("...d,dv->...v", self.norm(pre), self.lm_head.kernel.value.astype(pre.dtype),
                            preferred_element_type=jnp.float32)
        return pre, logits, cache.replace(keys=(keys,), values=(values,))

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return (draft_ids + self.d2t.value[draft_ids]).astype(jnp.int32)


class Eagle3Midlayer(nnx.Module):
    """The EAGLE-3 decoder layer: q/k/v read 2H inputs; the residual is the feature g."""

    def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        hidden, eps = cfg.hidden_size, cfg.layer.rms_norm_eps
        self.input_layernorm = layers.RMSNorm(hidden, eps, **kw)
        self.hidden_norm = layers.RMSNorm(hidden, eps, **kw)
        self.self_attn = layers.Attention(cfg.layer, input_size=2 * hidden, rngs=rngs, **kw)
        self.post_attention_layernorm = layers.RMSNorm(hidden, eps, **kw)
        self.mlp = layers.MLP(cfg.layer, rngs=rngs, **kw)

    def __call__(self, embedded, features, positions, keys, values):
        features = features.astype(embedded.dtype)
        z = jnp.concatenate([self.input_layernorm(embedded), self.hidden_norm(features)], axis=-1)
        attended, keys, values = self.self_attn(z, positions, keys, values)
        h = attended + features
        return h + self.mlp(self.post_attention_layernorm(h)), keys, values


def make_head(cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    head_class = {"eagle": Eagle1Head, "eagle3": Eagle3Head}[cfg.method]
    return head_class(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


def init_cache(cfg: EagleConfig, batch_size: int, max_length: int, dtype) -> kv_cache_lib.KVCache:
    layer = cfg.layer
    return kv_cache_lib.KVCache.create(1, batch_size, max_length, layer.num_kv_heads, layer.head_dim, dtype)
