"""Mapping HF tensor names onto Flax parameter paths, and building models from them.

Conversion is data: a table of HF key patterns to Flax paths. `map_tensors` applies a table
with shape checks; unmapped, missing or duplicate keys and shape mismatches are errors that
name the key. Flax paths are the NNX state paths joined by '/', e.g.
`layers/3/self_attn/qkv_proj/kernel`; that is also the key layout of the converted format.

Values are checked too: a floating parameter must come from a floating tensor (an int8 or
bool tensor there is refused, not cast) holding no NaN or Inf, and a config.json is checked
(every size a positive integer, the layer count the checkpoint's) before a model is built
from it, so a config claiming 200,000 layers fails at once instead of building them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.io import hf_files
from eagle_jax.model import config as config_lib


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF key pattern (regex, full match) and the Flax path it fills (`str.format` of its groups).

    A rule with `part` set fills one slice of a fused parameter: the parts, in index order, are
    concatenated along the last (output) axis (HF q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`).
    """

    pattern: str
    target: str
    transpose: bool = False  # HF Linear weights are [out, in]; NNX kernels are [in, out].
    part: int | None = None


def _linear(hf_prefix: str, flax_prefix: str, part: int | None = None) -> list[Rule]:
    return [
        Rule(hf_prefix + r"\.weight", flax_prefix + "/kernel", transpose=True, part=part),
        Rule(hf_prefix + r"\.bias", flax_prefix + "/bias", part=part),
    ]


def _fused_linear(hf_prefix: str, names: tuple[str, ...], flax_prefix: str) -> list[Rule]:
    return [rule for part, name in enumerate(names)
            for rule in _linear(rf"{hf_prefix}\.{name}", flax_prefix, part)]


def decoder_layer_rules(hf_prefix: str, flax_prefix: str) -> list[Rule]:
    """Rules for one Llama decoder layer; prefixes may contain regex groups such as `(?P<i>\\d+)`."""
    return [
        Rule(hf_prefix + r"\.input_layernorm\.weight", flax_prefix + "/input_layernorm/weight"),
        Rule(hf_prefix + r"\.post_attention_layernorm\.weight", flax_prefix + "/post_attention_layernorm/weight"),
        *_fused_linear(rf"{hf_prefix}\.self_attn", ("q_proj", "k_proj", "v_proj"), f"{flax_prefix}/self_attn/qkv_proj"),
        *_linear(rf"{hf_prefix}\.self_attn\.o_proj", f"{flax_prefix}/self_attn/o_proj"),
        *_fused_linear(rf"{hf_prefix}\.mlp", ("gate_proj", "up_proj"), f"{flax_prefix}/mlp/gate_up_proj"),
        *_linear(rf"{hf_prefix}\.mlp\.down_proj", f"{flax_prefix}/mlp/down_proj"),
    ]


def hf_name(rule: Rule, groups: dict[str, str]) -> str:
    """The HF key a rule matches for given group values (e.g. `model.layers.3.mlp.up_proj.weight`)."""
    return re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: groups[m.group(1)], rule.pattern).replace("\\", "")


LLAMA_RULES = [
    Rule(r"model\.embed_tokens\.weight", "embed_tokens/embedding"),
    Rule(r"model\.norm\.weight", "norm/weight"),
    Rule(r"lm_head\.weight", "lm_head/kernel", transpose=True),
    *decoder_layer_rules(r"model\.layers\.(?P<i>\d+)", "layers/{i}"),
]
# Buffers some exporters save that carry no learned weights.
LLAMA_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def map_tensors(tensors: dict[str, np.ndarray], rules: list[Rule], expected: dict[str, Any],
                ignored: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Renames HF tensors to Flax paths, checking every key and shape.

    Args:
        tensors: HF name -> array.
        rules: the conversion table.
        expected: Flax path -> anything with `.shape` (the abstract model state).
        ignored: HF name patterns to drop silently.
        optional: HF name patterns whose tensor is dropped when the model has no such path
            (e.g. `lm_head.weight` saved beside tied embeddings).

    Raises:
        hf_files.CheckpointError: naming the offending key.
    """
    compiled = [(re.compile(rule.pattern), rule) for rule in rules]
    # Flax path -> {part index: (HF name, array)}; a plain rule is the single part None.
    found: dict[str, dict] = {}
    rule_of: dict[str, tuple[Rule, dict]] = {}
    for name, array in tensors.items():
        if any(re.fullmatch(p, name) for p in ignored):
            continue
        for regex, rule in compiled:
            match = regex.fullmatch(name)
            if match:
                break
        else:
            raise hf_files.CheckpointError(f"unexpected tensor {name!r}: no conversion rule matches it")
        target = rule.target.format(**match.groupdict())
        if target not in expected:
            if any(re.fullmatch(p, name) for p in optional):
                continue
            raise hf_files.CheckpointError(f"tensor {name!r} maps to {target!r}, which this model does not have")
        parts = found.setdefault(target, {})
        if rule.part in parts:
            raise hf_files.CheckpointError(f"tensors {parts[rule.part][0]!r} and {name!r} both map to {target!r}")
        array = np.asarray(array)
        check_values(name, array, expected[target].dtype)
        parts[rule.part] = (name, array.T if rule.transpose else array)
        rule_of[target] = (rule, match.groupdict())
    missing = sorted(set(expected) - set(found))
    if missing:
        names = [name for target in missing for name in _hf_names(target, rules)]
        raise hf_files.CheckpointError(f"checkpoint lacks {len(names)} tensors, first: {names[:5]}")
    out = {}
    for target, parts in found.items():
        out[target] = _join_parts(target, parts, rule_of[target], rules, tuple(expected[target].shape))
    return out


def _hf_names(target: str, rules: list[Rule]) -> list[str]:
    """The HF key(s) that fill Flax path `target` (every part of a fused one), or the path itself."""
    names = []
    for rule in sorted(rules, key=lambda rule: rule.part or 0):
        match = re.fullmatch(re.sub(r"\{(\w+)\}", r"(?P<\1>\\d+)", rule.target), target)
        if match:
            names.append(hf_name(rule, match.groupdict()))
    return names or [target]


def _join_parts(target: str, parts: dict, found_rule: tuple[Rule, dict], rules: list[Rule],
                shape: tuple) -> np.ndarray:
    """One Flax parameter from its HF tensor(s), with the shape checked against the model's."""
    rule, groups = found_rule
    if rule.part is None:
        [(name, array)] = parts.values()
        if tuple(array.shape) != shape:
            raise hf_files.CheckpointError(
                f"tensor {name!r} has shape {tuple(array.shape)}, model expects {shape} at {target!r}")
        return array
    for sibling in rules:
        if sibling.target == rule.target and sibling.part not in parts:
            raise hf_files.CheckpointError(
                f"checkpoint lacks tensor {hf_name(sibling, groups)!r} (part {sibling.part + 1} of {target!r})")
    named = [parts[index] for index in sorted(parts)]
    if any(a.shape[:-1] != shape[:-1] for _, a in named) or sum(a.shape[-1] for _, a in named) != shape[-1]:
        got = ", ".join(f"{name!r} has shape {tuple(a.shape)}" for name, a in named)
        layout = " (shapes as [in, out] kernels)" if rule.transpose else ""
        raise hf_files.CheckpointError(
            f"tensors do not fit: {got}{layout}; joined on the last axis the model expects {shape} at {target!r}")
    return np.concatenate([a for _, a in named], axis=-1)


def check_values(name: str, array: np.ndarray, expected_dtype) -> None:
    """Refuses a tensor that cannot hold what the model expects there.

    A floating parameter needs a floating tensor (int8 weights stored with a `_scale`
    companion are widened before this, by `int8_weights.dequantize`), with no NaN or Inf in
    it; an integer one (EAGLE-3's d2t) needs an integer tensor.

    Raises:
        hf_files.CheckpointError: naming the tensor.
    """
    floating = jnp.issubdtype(expected_dtype, jnp.floating)
    if floating and not jnp.issubdtype(array.dtype, jnp.floating):
        hint = " (an int8 weight needs its '_scale' companion)" if array.dtype == np.int8 else ""
        raise hf_files.CheckpointError(f"tensor {name!r} has dtype {array.dtype}, where the model expects "
                                       f"floating weights{hint}")
    if not floating and not jnp.issubdtype(array.dtype, jnp.integer):
        raise hf_files.CheckpointError(f"tensor {name!r} has dtype {array.dtype}, where the model expects integers")
    if floating and not np.isfinite(array).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise hf_files.CheckpointError(f"tensor {name!r} holds {array[index]} at index {list(index)}: "
                                       "NaN or Inf weights are refused")


_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZE_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")


def llama_config(hf_config: dict, where: str = "config.json") -> config_lib.LlamaConfig:
    """`LlamaConfig.from_hf_config` for a config.json from anywhere, with clear errors.

    Args:
        hf_config: the parsed config.json.
        where: the file, for messages.

    Raises:
        hf_files.CheckpointError: a size field is missing, or is not a positive integer, or
            the config is otherwise one the model cannot take.
    """
    missing = [field for field in _SIZE_FIELDS if hf_config.get(field) is None]
    if missing:
        raise hf_files.CheckpointError(f"{where}: lacks {', '.join(missing)}")
    for field in _SIZE_FIELDS + _OPTIONAL_SIZE_FIELDS:
        value = hf_config.get(field)
        if value is not None and (type(value) is not int or value <= 0):
            raise hf_files.CheckpointError(f"{where}: {field} is {value!r}, expected a positive integer")
    for field in _OPTIONAL_POSITIVE_NUMBERS:
        value = hf_config.get(field)
        if value is not None and (type(value) not in (int, float) or not value > 0):
            raise hf_files.CheckpointError(f"{where}: {field} is {value!r}, expected a positive number")
    if hf_config.get("head_dim") is None and hf_config["hidden_size"] < hf_config["num_attention_heads"]:
        raise hf_files.CheckpointError(f"{where}: hidden_size={hf_config['hidden_size']} is smaller than "
                                       f"num_attention_heads={hf_config['num_attention_heads']} and no head_dim is given")
    try:
        return config_lib.LlamaConfig.from_hf_config(hf_config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise hf_files.CheckpointError(f"{where}: {error}") from None


def check_layer_count(names, num_layers: int, pattern: str, where: str, offset: int = 0) -> None:
    """Checks that tensors `names` hold exactly layers `offset..num_layers-1` (by `pattern`'s group 1).

    Run before a model is built: building one costs time per layer, so a config.json that
    claims more layers than its checkpoint holds is refused here, from names alone.

    Raises:
        hf_files.CheckpointError: naming both counts.
    """
    regex = re.compile(pattern)
    found = {int(match.group(1)) for name in names if (match := regex.match(name))}
    if found != set(range(offset, num_layers)):
        if offset or not found:  # the first layers have other names (EAGLE-3's midlayer): count them
            held = f"{offset + len(found)} layers"
        elif len(found) == max(found) - min(found) + 1:
            held = f"layers {min(found)}..{max(found)}"
        else:
            held = f"{len(found)} layers, numbered {sorted(found)[:5]}..."
        raise hf_files.CheckpointError(f"{where}: config.json says num_hidden_layers={num_layers}, but the "
                                       f"checkpoint holds {held}")


def split_parts(array: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """The inverse of joining: a fused parameter cut back into its HF tensors along the last axis."""
    if sum(sizes) != array.shape[-1]:
        raise ValueError(f"part sizes {sizes} do not add up to the fused width {array.shape[-1]}")
    return np.split(array, np.cumsum(sizes)[:-1], axis=-1)


def pure_dict(state: nnx.State) -> dict:
    """Nested plain dicts of arrays (`nnx.to_pure_dict` where this flax has it, else the older method)."""
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def flat_state(state: nnx.State) -> dict[str, Any]:
    """Flax path -> leaf, for an NNX state (abstract or concrete)."""
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk(pure_dict(state), "")
    return flat


def abstract_model(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """The module `factory` builds, with shapes only: nothing is allocated or initialised.

    Building a 30-layer model this way takes about a second on a CPU, so callers build it once
    and pass it to both `param_shapes` and `build_model`.
    """
    return nnx.eval_shape(factory)


def param_shapes(abstract: nnx.Module) -> dict[str, Any]:
    """Flax path -> abstract leaf (with `.shape` and `.dtype`) of every variable of a module."""
    return flat_state(nnx.split(abstract)[1])


def build_model(abstract: nnx.Module, params: dict[str, np.ndarray], dtype, check: bool = True) -> nnx.Module:
    """Fills an abstract module (`abstract_model`) from Flax-path arrays.

    Args:
        abstract: the module's shapes, from `abstract_model`.
        params: Flax path -> array, covering every parameter.
        dtype: the parameter dtype on device.
        check: run `check_values` on each array (`map_tensors` has, under the HF names).

    Raises:
        hf_files.CheckpointError: a parameter is missing, extra, or of the wrong shape or kind,
            or holds NaN or Inf.
    """
    graphdef, state = nnx.split(abstract)
    expected = flat_state(state)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise hf_files.CheckpointError(f"parameters do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    pure = pure_dict(state)

    def fill(node, prefix):
        for key, value in node.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, dict):
                fill(value, path)
            else:
                if tuple(params[path].shape) != tuple(value.shape):
                    raise hf_files.CheckpointError(f"{path!r} has shape {params[path].shape}, model expects {value.shape}")
                if check:
                    check_values(path, np.asarray(params[path]), value.dtype)
                # Only floating parameters take the model dtype; integer tables (EAGLE-3 d2t) stay exact.
                floating = jnp.issubdtype(value.dtype, jnp.floating)
                node[key] = jnp.asarray(params[path], dtype=dtype if floating else value.dtype)

    fill(pure, "")
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def model_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Flax path -> host array, the inverse of `build_model`."""
    return {path: np.asarray(jax.device_get(leaf)) for path, leaf in flat_state(nnx.state(model, nnx.Param)).items()}
