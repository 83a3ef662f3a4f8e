"""Model configuration: frozen dataclasses built from HF `config.json` dictionaries.

Frozen and hashable on purpose: a config is part of what a compiled program depends on, so
it is passed to `jax.jit` as a static argument and hashed into compile-cache keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The `llama3` rope_scaling block (Llama 3.1 and later)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder. Field names follow HF where HF's are full words."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Builds a config from the dictionary in an HF `config.json`.

        Raises:
            ValueError: for a rope scaling type other than `llama3` (silently ignoring it would
                give wrong logits at long range) or an inconsistent head layout.
        """
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        hidden_size = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        # transformers >= 5 writes rope_theta and the scaling block together as `rope_parameters`.
        rope = hf.get("rope_parameters") or {}
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        """Reads `config.json` (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()))


def _rope_scaling(block: dict[str, Any] | None) -> RopeScaling | None:
    if not block:
        return None
    kind = block.get("rope_type", block.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3' and default)")
    return RopeScaling(
        factor=float(block["factor"]),
        low_freq_factor=float(block["low_freq_factor"]),
        high_freq_factor=float(block["high_freq_factor"]),
        original_max_position_embeddings=int(block["original_max_position_embeddings"]),
    )
