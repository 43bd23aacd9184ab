"""Load a GGUF file (llama.cpp's format) of any registered architecture into canonical names, layout, float32.

What differs from a Hugging Face checkpoint is undone here:

* names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``
  (:data:`kvcore.model.architectures.GGUF_LAYER_NAMES` and the family's own names and fused tensors);
* quantisation: tensors may be Q4_1, Q8_0, K-quants, ...; they are dequantised with the ``gguf`` package, or
  kept as their blocks when the caller asks (``keep_quantized``: :mod:`kvcore.loaders.gguf_blocks`; the quantized
  weight formats run the types kvcore has codes for as stored, anything else is dequantised one tensor at a time
  as the model is built);
* Q/K row order ("llama" arch only): llama.cpp's converter interleaves the two halves of each head's rows
  (its RoPE rotates adjacent pairs, Hugging Face's rotates halves), so :func:`unpermute_qk` restores them;
* Gemma's norms are stored as ``1 + w``; Llama 3.1 / Phi-3 RoPE factors come as tensors.

Metadata gives the :class:`~kvcore.model.config.ModelConfig` (through the family's declaration) and the
tokenizer: byte-level BPE with the declared pre-tokenizer, or SentencePiece.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.loaders.gguf_blocks import GGUFBlocks, file_blocks
from kvcore.loaders.gguf_config import gguf_config, tensor_rope
from kvcore.loaders.gguf_format import GGUFLayout, GGUFTensorInfo
from kvcore.loaders.gguf_metadata import read_gguf, tensor_data
from kvcore.loaders.gguf_tokenizer import gguf_tokenizer
from kvcore.loaders.loaded import LoadedModel, check_layer_count, expected_shapes, split_rows, stored_tensors
from kvcore.model.architectures import Architecture
from kvcore.model.config import ModelConfig
from kvcore.text.tokenizer import Tokenizer

__all__ = ["SUPPORTED_TYPES", "load_gguf", "load_gguf_tokenizer", "unpermute_qk"]

T = TypeVar("T")

#: tensor encodings we dequantise (all have numpy kernels in the gguf package)
SUPPORTED_TYPES = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
)

#: stored as plain numbers: loaded as float32 tensors (the rest stay blocks with ``keep_quantized``)
_FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
#: canonical -> llama.cpp names of the tensors outside the layers
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
#: tensors that carry RoPE frequency factors, not weights
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# what a damaged tensor makes the gguf package's dequantizer raise (it has no exception type of its own)
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


def _open(path: Path) -> tuple[GGUFLayout, dict[str, Any]]:
    """The file's tensor table and its metadata as Python values; ModelLoadError for anything unreadable."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file '{path}' not found")
    return read_gguf(path)  # the counts and offsets bounded first (validate_gguf), then read


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter stores ``w.reshape(n_head, 2, d_h//2, in).swapaxes(1, 2)``: per head, rows
    of the first and second half interleaved. This restores Hugging Face's half-split order.

    Args:
        weight: [n_head * d_h, in] as stored in the GGUF.
        n_head: query heads for ``attn_q``, KV heads for ``attn_k``.
    Returns:
        [n_head * d_h, in] in Hugging Face order.
    """
    if weight.ndim == 1:  # a bias: the same row order
        return unpermute_qk(weight[:, None], n_head)[:, 0]
    out, inp = weight.shape
    return weight.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


#: rows of a quantized tensor dequantized per call (see :func:`_dequantize`)
_DEQUANT_ROWS = 4096


def _dequantize(tensor: GGUFTensorInfo, path: Path) -> np.ndarray:
    qtype = QType(tensor.ggml_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelLoadError(
            f"'{path}': tensor '{tensor.name}' has unsupported type {qtype.name} (supported: {supported})"
        )
    shape = tuple(reversed(tensor.dims))  # [ne1, ne0] in numpy order is Hugging Face's [out, in]
    data = tensor_data(path, tensor)
    try:
        if data.ndim != 2 or qtype in (QType.F32, QType.F16):
            return gguf.quants.dequantize(data, qtype).reshape(shape)
        # row chunks into one float32 array: gguf's dequantizer makes several full-size temporaries per call,
        # which for a big embedding table were the load's peak memory
        out = np.empty((data.shape[0], shape[-1]), dtype=np.float32)
        for start in range(0, data.shape[0], _DEQUANT_ROWS):
            rows = gguf.quants.dequantize(data[start : start + _DEQUANT_ROWS], qtype)
            out[start : start + _DEQUANT_ROWS] = rows.reshape(-1, shape[-1])
    except _READER_ERRORS as exc:
        raise ModelLoadError(f"'{path}': cannot decode tensor '{tensor.name}': {exc}") from None
    return out.reshape(shape)


def load_gguf(path: str | os.PathLike[str], name: str | None = None, keep_quantized: bool = False) -> LoadedModel:
    """Load a GGUF file of any registered architecture: config, float32 weights (canonical names), tokenizer.

    Args:
        path: the ``.gguf`` file.
        name: display name; defaults to the file name without ``.gguf``.
        keep_quantized: leave the quantized matrices (Q4_0, Q8_0, K-quants...) as
            :class:`~kvcore.loaders.gguf_blocks.GGUFBlocks` (their raw blocks, rows in Hugging Face order, read from
            the file when the model is built) instead of float32 tensors.
    """
    path = Path(path)
    layout, metadata = _open(path)
    arch, fields, meta = _checked(gguf_config, metadata, path)
    tokenizer = _checked(gguf_tokenizer, metadata, path)
    tensors = {t.name: t for t in layout.tensors}
    rope = {n: _dequantize(tensors.pop(n), path).reshape(-1).tolist() for n in _ROPE_TENSORS if n in tensors}
    fields["rope_scaling"] = tensor_rope(fields, rope, meta)
    fields["tie_word_embeddings"] = "output.weight" not in tensors
    # llama.cpp has no metadata key for projection biases: the tensors are the declaration
    fields["attention_bias"] = fields.get("attention_bias", False) or "blk.0.attn_q.bias" in tensors
    fields["attention_output_bias"] = "blk.0.attn_output.bias" in tensors
    try:
        config = ModelConfig(**fields)
    except ModelLoadError as exc:
        raise ModelLoadError(f"'{path}': {exc}") from None
    check_layer_count(config, tensors, "blk.{i}.", f"'{path}'")
    shapes = expected_shapes(config)
    stored = stored_tensors(shapes, config.num_hidden_layers, arch.layer_names("gguf"), "blk.{i}.", _GLOBAL_NAMES)
    for gguf_name in tensors:
        if gguf_name not in stored:
            what = "a bias" if gguf_name.endswith(".bias") else "unexpected"
            raise ModelLoadError(f"'{path}': unsupported: tensor '{gguf_name}' ({what} for a {arch.name} model)")
    missing = [parts[0] for n, parts in stored.items() if n not in tensors]
    if missing:
        raise ModelLoadError(f"'{path}': missing tensor for '{missing[0]}' ({len(missing)} missing in all)")
    weights: dict[str, torch.Tensor] = {}
    for gguf_name, parts in stored.items():
        tensor = tensors[gguf_name]
        shape = tuple(reversed(tensor.dims))
        expected = (sum(shapes[n][0] for n in parts), *shapes[parts[0]][1:])
        if shape != expected:
            raise ModelLoadError(
                f"'{path}': tensor '{gguf_name}' ({', '.join(parts)}) has shape {list(shape)}, "
                f"expected {list(expected)} from the metadata"
            )
        if keep_quantized and QType(tensor.ggml_type) not in _FLOAT_TYPES and len(shape) == 2:
            # read from the file when the model is built, one tensor at a time (see GGUFBlocks)
            values = GGUFBlocks(QType(tensor.ggml_type), file_blocks(path, tensor.offset, tensor.nbytes), shape)
        else:
            values = torch.from_numpy(np.ascontiguousarray(_dequantize(tensor, path), dtype=np.float32))
        for canonical, value in split_rows(values, parts, shapes).items():
            weights[canonical] = _from_llama_cpp(canonical, value, arch, config)
    return LoadedModel(
        config=config,
        weights={n: weights[n] for n in shapes},  # canonical order: embeddings, layer by layer, norm, head
        tokenizer=tokenizer,
        source=str(path),
        name=name or path.name.removesuffix(".gguf"),
    )


def _from_llama_cpp(name: str, value: torch.Tensor | GGUFBlocks, arch: type[Architecture], config: ModelConfig):
    """Undo what llama.cpp's converter did to a tensor: Q/K row interleaving, norm offsets added."""
    if isinstance(value, GGUFBlocks):  # a row permutation: the same on whole rows of blocks
        heads = {".q_proj.": config.num_attention_heads, ".k_proj.": config.num_key_value_heads}
        for part, n in heads.items():
            if arch.gguf_permute_qk and part in name:
                return value.map_rows(lambda rows, n=n: unpermute_qk(rows, n))
        return value
    if arch.gguf_permute_qk and ".q_proj." in name:
        value = torch.from_numpy(unpermute_qk(value.numpy(), config.num_attention_heads))
    elif arch.gguf_permute_qk and ".k_proj." in name:
        value = torch.from_numpy(unpermute_qk(value.numpy(), config.num_key_value_heads))
    elif arch.gguf_norm_offset_baked and name.endswith("norm.weight"):
        value = value - config.norm_offset
    return value.contiguous()


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads metadata, no tensor data)."""
    path = Path(path)
    _, metadata = _open(path)
    return _checked(gguf_tokenizer, metadata, path)


def _checked(build: Callable[[dict[str, Any], Path], T], metadata: dict[str, Any], path: Path) -> T:
    """``build(metadata, path)``, with a metadata value of the wrong type reported as ModelLoadError."""
    try:
        return build(metadata, path)
    except ModelLoadError as exc:  # a message from deeper down (tokenizer, RoPE) may not name the file yet
        raise exc if str(path) in str(exc) else ModelLoadError(f"'{path}': {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"'{path}': malformed GGUF metadata: {exc}") from None
