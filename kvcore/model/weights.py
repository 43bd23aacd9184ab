"""Which weight format a decoder runs with (``EngineConfig.weights``), and its quantized matmul weights.

:mod:`kvcore.kernels.quant` has the formats and kernels; this module maps a model's canonical weights (float tensors,
or GGUF blocks kept by ``load_model(..., keep_quantized=True)``) onto them, one callable per fused matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcore.errors import ModelLoadError
from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.group_quant import GroupCodes, Int8GroupLinear
from kvcore.kernels.huge_pages import Relocatable, move_into_huge_pages
from kvcore.kernels.int8 import Int8Linear
from kvcore.kernels.linear import DenseLinear, prepack
from kvcore.kernels.quant import (
    A8_GROUP,
    DEFAULT_GROUP_SIZE,
    Int4A8Linear,
    Int4Groups,
    Int4Linear,
    check_runnable,
    check_weight_format,
    quantized_reasons,
)
from kvcore.model.config import ModelConfig

__all__ = ["WeightCopier", "copy_weights", "LINEAR_PARTS", "dense", "resolve_weights", "quantized_linears",
           "uses_quantized_blocks"]

#: the model's fused matmul lists -> the canonical weights (under ``model.layers.{i}.``) stacked in each
LINEAR_PARTS = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def dense(value: Any) -> torch.Tensor:
    """A float tensor of ``value``: a tensor as is, GGUF blocks dequantized."""
    return value if isinstance(value, torch.Tensor) else value.dequantize()


def _linear_weights(config: ModelConfig, weights: Mapping[str, Any]):
    for i in range(config.num_hidden_layers):
        for parts in LINEAR_PARTS.values():
            for part in parts:
                yield weights.get(f"model.layers.{i}.{part}")


def uses_quantized_blocks(requested: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a loader should keep a GGUF's quantized blocks for this request (else it may dequantize all)."""
    if requested in ("int4", "int4a8", "gguf"):
        return True
    return requested == "auto" and not quantized_reasons("int4", dtype, device)


def resolve_weights(
    requested: str, dtype: torch.dtype, device: torch.device | str, config: ModelConfig, weights: Mapping[str, Any]
) -> str:
    """The format a model runs with: ``requested``, or for ``auto`` in bfloat16 ``int4`` when every layer weight is a
    Q4_0 / Q4_1 GGUF block tensor and int4 runs on ``device``, ``gguf`` when every one is of a type the ``gguf``
    format runs and it runs here, else ``float`` (and always in float32, the exact reference: the engine's defaults,
    :mod:`kvcore.engine.defaults`, ask for quantized weights with float32 activations by name). ConfigError when a
    quantized format cannot run here."""
    check_weight_format(requested)
    if requested == "auto":
        if dtype != torch.bfloat16:
            return "float"
        layer_weights = list(_linear_weights(config, weights))
        if all(getattr(w, "int4_exact", False) for w in layer_weights) and not quantized_reasons("int4", dtype, device):
            return "int4"
        coded = all(getattr(w, "has_codes", False) for w in layer_weights)
        return "gguf" if coded and not quantized_reasons("gguf", dtype, device) else "float"
    return check_runnable(requested, dtype, device)


def quantized_linears(
    config: ModelConfig,
    weights: Mapping[str, Any],
    fmt: str,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """``{"qkv" | "o" | "gate_up" | "down": [one callable per layer]}`` in ``fmt`` (``int4``, ``int4a8``, ``int8``,
    ``gguf``).

    int4: GGUF Q4_0/Q4_1/Q4_K blocks as stored (groups of 32); other weights quantized per ``group_size`` columns.
    int4a8: the same int4 weights, always in groups of 32 (its kernel's activation groups).
    gguf: GGUF blocks as stored (:mod:`kvcore.kernels.group_quant`); a fused matmul with a part of another type
    (float, Q2_K, Q3_K) stays dense. A matrix the kernel cannot take (output rows not a multiple of 16, input
    columns not whole groups) stays dense in ``dtype``."""
    if fmt not in ("int4", "int4a8", "int8", "gguf"):
        raise ValueError(f"not a quantized weight format: {fmt!r}")
    out: dict[str, list] = {name: [] for name in LINEAR_PARTS}
    reordered = []  # (name, layer, values) of Q4_0 / Q4_1 blocks, written once, straight where they end
    for i in range(config.num_hidden_layers):
        for name, parts in LINEAR_PARTS.items():
            values = [weights[f"model.layers.{i}.{part}"] for part in parts]
            if fmt in ("int4a8", "gguf") and _layout_specs(values):
                reordered.append((name, i, values))
                out[name].append(None)
            else:
                out[name].append(_quantize(values, fmt, dtype, group_size))
    # one region in huge pages for every kvcore-kernel weight: a decode step streams them all (kernels/huge_pages.py)
    arena = move_into_huge_pages([f for fns in out.values() for f in fns if isinstance(f, Relocatable)],
                                 [spec for _, _, values in reordered for spec in _layout_specs(values)])
    empty = arena.empty if arena is not None else lambda shape, dtype: torch.empty(shape, dtype=dtype)
    for name, i, values in reordered:
        out[name][i] = _from_layouts(values, dtype, empty) or _quantize(values, fmt, dtype, group_size)
    return out


def _layout_specs(values: list[Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The ``(shape, dtype)`` of the int4a8 ``(codes, dm)`` of ``values`` stacked, when every one is Q4_0 / Q4_1 blocks
    in whole blocks of 16 rows (their codes are then the kernel's, reordered: nothing decoded), else ``[]``."""
    rows, cols = sum(v.shape[0] for v in values), values[0].shape[1]
    if not all(getattr(v, "int4_exact", False) and v.shape[0] % 16 == 0 for v in values):
        return []
    if not Int4A8Linear.fits(rows, cols, A8_GROUP):
        return []
    blocks = (rows // 16, cols // A8_GROUP)
    return [((*blocks, 256), torch.uint8), ((*blocks, 2, 16), torch.float16)]


def _from_layouts(values: list[Any], dtype: torch.dtype, empty: Callable) -> Int4A8Linear | None:
    """``values`` (:func:`_layout_specs`) as one :class:`Int4A8Linear` whose tensors ``empty(shape, dtype)`` makes,
    each part's blocks reordered into its rows; None when a Q4_0 offset ``-8 d`` has no float16 value."""
    codes, dm = (empty(shape, dt) for shape, dt in _layout_specs(values))
    at = 0
    for v in values:
        n = v.shape[0] // 16
        if v.int4a8_layout((codes[at : at + n], dm[at : at + n])) is None:
            return None  # its room in the arena stays unused; _quantize packs it from its codes
        at += n
    return Int4A8Linear.from_layout(codes, dm, dtype)


def _quantize(values: list[Any], fmt: str, dtype: torch.dtype, group_size: int):
    rows, cols = sum(v.shape[0] for v in values), values[0].shape[1]
    bits = [getattr(v, "code_bits", None) for v in values]  # None: a float tensor or a type without codes
    codes = GroupCodes.cat([v.codes() for v in values]) if None not in bits and fmt != "int8" else None
    four_bit = codes is not None and codes.bits == 4 and codes.group_size == A8_GROUP
    if fmt == "gguf" and codes is not None:
        if four_bit and Int4A8Linear.fits(rows, cols, A8_GROUP):
            return Int4A8Linear(codes, dtype)
        if Int8GroupLinear.fits(rows, cols, codes.group_size):
            return Int8GroupLinear(codes, dtype)
    elif fmt in ("int4", "int4a8"):
        cls, group_size = (Int4Linear, group_size) if fmt == "int4" else (Int4A8Linear, A8_GROUP)
        if four_bit and cls.fits(rows, cols, A8_GROUP):
            return cls(codes.int4_groups() if fmt == "int4" else codes, dtype)
        if cls.fits(rows, cols, group_size):
            w = torch.cat([dense(v) for v in values])
            return cls(Int4Groups.from_float(w, group_size, dtype), dtype)
    elif fmt == "int8" and Int8Linear.fits(rows, cols):
        return Int8Linear(torch.cat([dense(v) for v in values]), dtype)
    w = torch.cat([dense(v) for v in values]).to(dtype).contiguous()
    return DenseLinear(w, prepack(w) if cpu_features().bf16_matmul else None)


class WeightCopier:
    """Copies named tensors of a checkpoint (kvcore's canonical names) into a model's parameters: shapes
    checked against the parameter, norm weights offset as the config says (Gemma's ``1 + w``, folded in
    float32), values cast to the model's dtype. A missing name or a wrong shape is a ModelLoadError."""

    def __init__(self, weights: dict[str, Any], config: ModelConfig, dtype: torch.dtype) -> None:
        self.weights, self.config, self.dtype = weights, config, dtype

    def take(self, name: str) -> torch.Tensor:
        try:
            return dense(self.weights[name])
        except KeyError:
            raise ModelLoadError(f"model weights lack '{name}'") from None

    def put(self, param: torch.Tensor, names: list[str], norm: bool = False) -> None:
        """``param`` = the tensor ``names[0]``, or the named tensors concatenated along dim 0 (fused Q/K/V)."""
        value = self.weights.get(names[0])
        if len(names) == 1 and hasattr(value, "dequantize_into") and tuple(param.shape) == tuple(value.shape):
            value.dequantize_into(param)  # GGUF blocks straight into the parameter: no float32 copy of a big table
            return
        value = self.take(names[0]) if len(names) == 1 else torch.cat([self.take(n) for n in names], 0)
        if tuple(param.shape) != tuple(value.shape):
            name = ", ".join(names)
            raise ModelLoadError(f"weight '{name}' has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        if norm and self.config.norm_offset:
            value = value.float() + self.config.norm_offset
        param.copy_(value.to(self.dtype))


def copy_weights(model, put_names) -> None:
    """Copy every dense tensor of ``model`` (a :class:`~kvcore.model.decoder.DecoderModel` being built) from the
    canonical names with ``put_names`` (:meth:`WeightCopier.put`): the embedding unless it is held as blocks, the
    untied LM head, the dense layer matmuls unless they are quantized, the biases and the norms."""
    c = model.config
    with torch.no_grad():
        if model.embedding is None:
            put_names(model.embed_tokens, ["model.embed_tokens.weight"])
        put_names(model.norm, ["model.norm.weight"], norm=True)
        if not c.tie_word_embeddings:
            put_names(model.lm_head, ["lm_head.weight"])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if model._quantized is None:
                put_names(model.qkv_proj[i], [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
                put_names(model.o_proj[i], [p + "self_attn.o_proj.weight"])
                put_names(model.gate_up_proj[i], [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
                put_names(model.down_proj[i], [p + "mlp.down_proj.weight"])
            if model.qkv_bias is not None:
                put_names(model.qkv_bias[i], [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            if model.q_norm is not None:
                put_names(model.q_norm[i], [p + "self_attn.q_norm.weight"], norm=True)
                put_names(model.k_norm[i], [p + "self_attn.k_norm.weight"], norm=True)
            if model.o_bias is not None:
                put_names(model.o_bias[i], [p + "self_attn.o_proj.bias"])
            put_names(model.input_norm[i], [p + "input_layernorm.weight"], norm=True)
            if c.sandwich_norms:  # Gemma 2's names: post_attention_layernorm follows attention
                put_names(model.post_attn_norm[i], [p + "post_attention_layernorm.weight"], norm=True)
                put_names(model.post_norm[i], [p + "pre_feedforward_layernorm.weight"], norm=True)
                put_names(model.post_mlp_norm[i], [p + "post_feedforward_layernorm.weight"], norm=True)
            else:
                put_names(model.post_norm[i], [p + "post_attention_layernorm.weight"], norm=True)
