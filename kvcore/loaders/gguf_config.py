"""A GGUF file's metadata read into kvcore's model configuration: the architecture, its size and RoPE
fields (llama.cpp's ``{arch}.*`` keys), each checked with the file named in the error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvcore.errors import ModelLoadError
from kvcore.model.architectures import Architecture, f32
from kvcore.model.config import checked_number, checked_size
from kvcore.model.rope import RopeScaling
from kvcore.plugins.architectures import for_gguf_arch

__all__ = ["gguf_config", "gguf_rope_scaling", "tensor_rope"]


def gguf_config(metadata: dict[str, Any], path: Path) -> tuple[type[Architecture], dict[str, Any], dict[str, Any]]:
    """The architecture, the ModelConfig fields of the metadata (tie_word_embeddings and RoPE factors
    stored as tensors are settled by the caller, from the tensors) and the ``{arch}.`` keys unprefixed."""
    arch = for_gguf_arch(metadata.get("general.architecture"), str(path))
    name = arch.gguf_arch
    meta = {k.removeprefix(f"{name}."): v for k, v in metadata.items() if k.startswith(f"{name}.")}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(key, default)
        if value is None:
            raise ModelLoadError(f"'{path}': GGUF metadata key '{name}.{key}' is missing")
        return value

    where = f"'{path}': GGUF metadata"

    def size(field: str, key: str, default: Any = None) -> int:
        # bounded before anything (a family's per-layer option tuples included) is sized by it
        return checked_size(field, get(key, default), f"{where} '{name}.{key}' ({field})")

    def number(field: str, key: str, default: float) -> float:
        return f32(checked_number(field, get(key, default), f"{where} '{name}.{key}' ({field})"))

    if meta.get("expert_count"):
        raise ModelLoadError(f"'{path}': unsupported: mixture-of-experts {name} models")
    hidden = size("hidden_size", "embedding_length")
    heads = size("num_attention_heads", "attention.head_count")
    head_dim = size("head_dim", "attention.key_length", max(hidden // heads, 1))
    value_dim = size("head_dim", "attention.value_length", head_dim)
    rope_dim = size("head_dim", "rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ModelLoadError(
            f"'{path}': unsupported attention shape (key {head_dim}, value {value_dim}, rotary {rope_dim}"
            " dims); kvcore needs them equal"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = meta.get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        architecture=arch.name,
        vocab_size=size("vocab_size", "vocab_size", vocab),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size", "feed_forward_length"),
        num_hidden_layers=size("num_hidden_layers", "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=size("num_key_value_heads", "attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=size("max_position_embeddings", "context_length"),
        rms_norm_eps=number("rms_norm_eps", "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number("rope_theta", "rope.freq_base", 10000.0),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=int(eos) if eos is not None else None,
        **arch.options,
    )
    fields["rope_scaling"] = gguf_rope_scaling(meta, name, path)
    try:
        fields.update(arch.gguf_options(meta, fields))
    except ModelLoadError as exc:  # a family's option out of range: name the file
        raise ModelLoadError(f"'{path}': {exc}") from None
    return arch, fields, meta


def gguf_rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> RopeScaling | None:
    """RoPE scaling from ``{arch}.rope.scaling.*`` (linear and YaRN; llama3 and longrope come as tensors)."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = f32(meta.get("rope.scaling.factor") or 0.0)
    original = meta.get("rope.scaling.original_context_length")
    if kind == "linear" and factor:
        return RopeScaling("linear", factor=factor)
    if kind == "yarn" and original:
        keys = {k: f"rope.scaling.yarn_{k}" for k in ("beta_fast", "beta_slow")}
        extra = {k: f32(meta[key]) for k, key in keys.items() if key in meta}
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=int(original), **extra)
    raise ModelLoadError(f"'{path}': unsupported rope scaling '{kind}' in {arch}.rope.scaling.type")


def tensor_rope(fields: dict[str, Any], rope: dict[str, list[float]], meta: dict[str, Any]) -> RopeScaling | None:
    """RoPE factors stored as tensors: Llama 3.1's ``rope_freqs`` (frequency divisors) and Phi-3's
    ``rope_factors_long`` / ``rope_factors_short`` (longrope)."""
    scaling = fields["rope_scaling"]
    if "rope_freqs.weight" in rope:
        base = scaling or RopeScaling()
        return dataclasses.replace(base, freq_factors=tuple(rope["rope_freqs.weight"]))
    if "rope_factors_long.weight" in rope:
        short = rope.get("rope_factors_short.weight", rope["rope_factors_long.weight"])
        original = meta.get("rope.scaling.original_context_length") or fields["max_position_embeddings"]
        factor = meta.get("rope.scaling.attn_factor")
        return RopeScaling(
            "longrope",
            original_max_position_embeddings=int(original),
            attention_factor=f32(factor) if factor is not None else None,
            short_factor=tuple(short),
            long_factor=tuple(rope["rope_factors_long.weight"]),
        )
    return scaling
