"""EAGLE-1 and EAGLE-3 draft heads.

Both heads share one interface, so the speculative loop and the trainer do not care which runs:
  * `project(target_features)`: target features -> the head's feature space [.., D].
  * `attention_input(embedded, features, decode_kernels="xla")` -> (attention input, residual: the
    input an array, or with fused kernels a `layers.NormedInputs` for q/k/v's kernel); `attention`, the
    layer's `layers.Attention`; `finish(h, decode_kernels="xla")` -> next features, h being the
    residual plus the attention's projected output; `logits(out, target, decode_kernels="xla")`.
  * `extra_layers`: EAGLE-3 only, plain Llama decoder layers after the first (empty for one layer).
  * `__call__(tokens, features, positions, cache, target, mask=None, attend_length=None, kernels=XLA)`: every
    layer, each with its layer of the KV cache (`mask`: `layers.SlotMask` for tree drafting;
    `attend_length`: as `layers.Attention`); returns (next features [B, T, D], logits [B, T, V_draft], cache).
  * `to_target_ids(draft_ids)`: draft vocabulary -> target vocabulary.
The split lets training run the same layers under its own attention pattern (training-time test):
`forward_layers` runs them all and takes attention as an argument.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.kernels import fused_linear
from eagle_jax.model import config as config_lib
from eagle_jax.model import float32_logits
from eagle_jax.model import int8_linear
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """A draft head: its layers' Llama config plus what is specific to the EAGLE kind."""

    method: str  # "eagle" (EAGLE-1) or "eagle3"
    layer: config_lib.LlamaConfig
    fc_bias: bool = False  # EAGLE-1 only
    draft_vocab_size: int = 0  # EAGLE-3 only
    target_hidden_size: int = 0  # EAGLE-3: width of each captured target feature
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose inputs are captured
    # Decoder layers. EAGLE-3 may have more than one (its first is the midlayer, the rest plain
    # Llama layers, `layers.1..` in the public layout as vLLM reads it); EAGLE-1 has one.
    num_layers: int = 1

    def __post_init__(self):
        if self.num_layers < 1 or (self.method == "eagle" and self.num_layers != 1):
            raise ValueError(f"an {self.method} head has {'exactly one' if self.method == 'eagle' else 'at least one'} "
                             f"decoder layer, got num_layers={self.num_layers}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


# The draft lm_head's kernel reads a [576, 32,768] weight for one or a few rows: narrower K chunks
# and wider column strips than `fused_linear.Tiling`'s defaults keep more loads in flight. At one
# row on an H100 (L2 evicted): 16.3 us against 24.6 with the default tiling and 19.3 for XLA's
# norm and matmul (docs/benchmarks.md#the-decode-step). Read as int8 (`int8_linear`), a strip of
# 128 columns is best: 11.5 us against 14.0 at 64 and 16.4 for XLA's.
LM_HEAD_TILING = fused_linear.Tiling(block_n=64, block_k=64)
LM_HEAD_INT8_TILING = fused_linear.Tiling(block_n=128, block_k=64)


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

    @property
    def attention(self) -> layers.Attention:
        return self.self_attn

    def attention_input(self, embedded, features, decode_kernels: str = "xla"):
        x = self.fc(jnp.concatenate([embedded, features.astype(embedded.dtype)], axis=-1))
        return x, x  # layer 0 has no input norm

    def finish(self, h, decode_kernels: str = "xla"):
        return layers.residual_mlp(h, self.post_attention_layernorm, self.mlp, decode_kernels)

    @property
    def extra_layers(self) -> tuple:
        return ()

    def logits(self, out, target: llama.Llama, decode_kernels: str = "xla"):
        return target.logits(out)

    def __call__(self, tokens, features, positions, cache: kv_cache_lib.KVCache, target: llama.Llama,
                 mask: layers.SlotMask | None = None, attend_length: int | None = None,
                 kernels: layers.Kernels = layers.XLA):
        return _cached_forward(self, tokens, features, positions, cache, target, mask, attend_length, kernels)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids


class Eagle3Head(nnx.Module):
    """EAGLE-3 midlayer over concat(input_layernorm(embed), hidden_norm(g)), then `num_layers - 1`
    plain Llama decoder layers, own norm and lm_head."""

    def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.config = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        hidden, eps = cfg.hidden_size, cfg.layer.rms_norm_eps
        num_features = len(cfg.feature_layers)
        self.fc = nnx.Linear(num_features * cfg.target_hidden_size, hidden, use_bias=False, rngs=rngs, **kw)
        self.midlayer = Eagle3Midlayer(cfg, rngs=rngs, **kw)
        self.layers = nnx.List([layers.DecoderLayer(cfg.layer, rngs=rngs, **kw) for _ in range(cfg.num_layers - 1)])
        self.norm = layers.RMSNorm(hidden, eps, **kw)
        self.lm_head = nnx.Linear(hidden, cfg.draft_vocab_size, use_bias=False, rngs=rngs, **kw)
        # d2t[i] = target_id - draft_id; a Param-free variable so it travels with the weights.
        self.d2t = nnx.Variable(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    def project(self, target_features: jax.Array) -> jax.Array:
        return self.fc(target_features.astype(self.fc.kernel[...].dtype))

    @property
    def attention(self) -> layers.Attention:
        return self.midlayer.self_attn

    def attention_input(self, embedded, features, decode_kernels: str = "xla"):
        features = features.astype(embedded.dtype)
        layer = self.midlayer
        return layers.normed_inputs((embedded, features), (layer.input_layernorm, layer.hidden_norm),
                                    decode_kernels), features

    def finish(self, h, decode_kernels: str = "xla"):
        layer = self.midlayer
        return layers.residual_mlp(h, layer.post_attention_layernorm, layer.mlp, decode_kernels)

    @property
    def extra_layers(self) -> nnx.List:
        return self.layers

    def logits(self, out, target: llama.Llama, decode_kernels: str = "xla"):
        """Float32 logits over the draft vocabulary; an `int8_linear.Int8Linear` lm_head (a head
        stored int8 and run in 16 bits, `io.models.load_head`) is read as int8 either way."""
        int8 = isinstance(self.lm_head, int8_linear.Int8Linear)
        if layers.uses_decode_kernels(decode_kernels, out, self.lm_head):  # the final norm in the lm_head's kernel
            return fused_linear.norm_linear(out, self.norm.weight[...], self.norm.eps, self.lm_head.kernel[...],
                                            weight_scale=self.lm_head.scale[...] if int8 else None,
                                            implementation=layers.fused_kernels(decode_kernels), out_dtype=jnp.float32,
                                            tiling=LM_HEAD_INT8_TILING if int8 else LM_HEAD_TILING)
        if int8:
            return self.lm_head(self.norm(out))
        return float32_logits.float32_logits(self.norm(out), self.lm_head.kernel[...])

    def __call__(self, tokens, features, positions, cache: kv_cache_lib.KVCache, target: llama.Llama,
                 mask: layers.SlotMask | None = None, attend_length: int | None = None,
                 kernels: layers.Kernels = layers.XLA):
        return _cached_forward(self, tokens, features, positions, cache, target, mask, attend_length, kernels)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return (draft_ids + self.d2t[...][draft_ids]).astype(jnp.int32)


class Eagle3Midlayer(nnx.Module):
    """The EAGLE-3 decoder layer's weights: q/k/v read 2H inputs; the residual is the feature g.

    Its forward lives in `Eagle3Head.attention_input` / `finish`; this module only keeps the
    checkpoint's `midlayer.*` names.
    """

    def __init__(self, cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        hidden, eps = cfg.hidden_size, cfg.layer.rms_norm_eps
        self.input_layernorm = layers.RMSNorm(hidden, eps, **kw)
        self.hidden_norm = layers.RMSNorm(hidden, eps, **kw)
        self.self_attn = layers.Attention(cfg.layer, input_size=2 * hidden, rngs=rngs, **kw)
        self.post_attention_layernorm = layers.RMSNorm(hidden, eps, **kw)
        self.mlp = layers.MLP(cfg.layer, rngs=rngs, **kw)


def capture_layers(head) -> tuple[int, ...]:
    """The target layers whose outputs `head` reads: EAGLE-3's fused low, middle and high layers;
    none for EAGLE-1, which reads the target's final hidden state."""
    return head.config.feature_layers if isinstance(head, Eagle3Head) else ()


def target_features(head, hidden: jax.Array, captured: jax.Array | None) -> jax.Array:
    """The feature stream `head` reads from the target, in its own space [B, T, D]: EAGLE-3 projects
    the captured layers (`capture_layers`), EAGLE-1 the final hidden state (its `project` is the identity)."""
    return head.project(captured if isinstance(head, Eagle3Head) else hidden)


def forward_layers(head, embedded, features, attend, decode_kernels: str = "xla"):
    """The head's layers over (embedded token, feature) pairs; returns the last layer's output.

    That output, before the head's final norm, is both what `logits` reads and the feature fed
    back to the next draft step. `attend(index, attention, x, residual)` runs layer `index`'s
    attention (`layers.Attention`) on its normed input x and returns residual plus the projected
    output: a KV cache at inference, the training-time-test pattern in training. Where the fused
    kernels run (`decode_kernels`), x is a `layers.NormedInputs` that q/k/v's kernel norms as it
    loads it, and o_proj adds the residual in its kernel.
    """
    x, residual = head.attention_input(embedded, features, decode_kernels)
    out = head.finish(attend(0, head.attention, x, residual), decode_kernels)
    for index, layer in enumerate(head.extra_layers, start=1):
        h = attend(index, layer.self_attn, layers.normed_inputs((out,), (layer.input_layernorm,), decode_kernels), out)
        out = layers.residual_mlp(h, layer.post_attention_layernorm, layer.mlp, decode_kernels)
    return out


def _cached_forward(head, tokens, features, positions, cache: kv_cache_lib.KVCache, target: llama.Llama,
                    mask: layers.SlotMask | None = None, attend_length: int | None = None,
                    kernels: layers.Kernels = layers.XLA):
    """One draft forward over T (token, feature) pairs with the head's KV cache (one layer each),
    its cached calls in `kernels` (as the target's decode steps)."""
    keys, values = list(cache.keys), list(cache.values)

    def attend(index, attention, x, residual):
        if layers.uses_attention_kernel(kernels.decode_kernels, residual, mask, attention):
            attended, keys[index], values[index] = layers.kernel_attend(
                attention, layers.project_qkv(attention, x, kernels.decode_kernels), positions, keys[index],
                values[index], mask, attend_length, kernels.attention_tiling)
            return layers.output_residual(attention, attended, residual, kernels.decode_kernels)
        attended, keys[index], values[index] = attention(layers.input_value(x), positions, keys[index], values[index],
                                                         mask=mask, attend_length=attend_length)
        return residual + attended

    out = forward_layers(head, target.embed_tokens(tokens), features, attend, kernels.decode_kernels)
    return out, head.logits(out, target, kernels.decode_kernels), cache.replace(keys=tuple(keys), values=tuple(values))


def make_head(cfg: EagleConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    head_class = {"eagle": Eagle1Head, "eagle3": Eagle3Head}[cfg.method]
    return head_class(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


def init_cache(cfg: EagleConfig, batch_size: int, max_length: int, dtype) -> kv_cache_lib.KVCache:
    layer = cfg.layer
    return kv_cache_lib.KVCache.create(cfg.num_layers, batch_size, max_length, layer.num_kv_heads, layer.head_dim, dtype)
