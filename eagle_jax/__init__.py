"""EAGLE-1 / EAGLE-3 speculative decoding for Llama-family models in JAX.

Library use (the default model, SmolLM2-135M-Instruct, with its shipped EAGLE-3 head)::

    import eagle_jax
    from eagle_jax import heads
    from eagle_jax.io import tokenization

    target, tokenizer_dir = eagle_jax.load_target(None, "float32")
    head = eagle_jax.load_head(heads.shipped_head("eagle3"), target)
    engine = eagle_jax.Engine(target, head, eagle_jax.EngineConfig(num_speculative_tokens=3))
    ids = tokenization.encode(tokenization.load(tokenizer_dir), "Write a haiku about the sea.", True)
    [result] = engine.generate([ids], max_new_tokens=64, sampling=eagle_jax.Sampling())
    print(result.token_ids, result.stats["acceptance_length"])

The names below load on first use, so importing `eagle_jax` (or one of its subpackages) does
not import JAX nor change its configuration.
"""

from __future__ import annotations

import importlib

# Public name -> (module, attribute).
_PUBLIC = {
    "Engine": ("eagle_jax.serve.engine", "Engine"),
    "EngineConfig": ("eagle_jax.serve.config", "EngineConfig"),
    "Result": ("eagle_jax.serve.result", "Result"),
    "load_target": ("eagle_jax.io.models", "load_target"),
    "load_head": ("eagle_jax.io.models", "load_head"),
    "Sampling": ("eagle_jax.decode.sampling", "Sampling"),
    "TreeOptions": ("eagle_jax.decode.tree", "TreeOptions"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'eagle_jax' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
