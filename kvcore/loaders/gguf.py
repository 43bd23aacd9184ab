"""Load a Llama GGUF file (llama.cpp's format) into Hugging Face names, layout and float32.

Three things differ from a Hugging Face checkpoint and are undone here:

* names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight`` (see ``_LAYER_NAMES``);
* quantisation: tensors may be Q4_1, Q8_0, ...; they are dequantised with the ``gguf`` package;
* Q/K row order: llama.cpp's converter interleaves the two halves of each head's rows (its RoPE
  rotates adjacent pairs, Hugging Face's rotates halves), so :func:`unpermute_qk` restores them.

Metadata gives the :class:`~kvcore.model_config.ModelConfig` and the tokenizer (byte-level BPE only).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.loaders import LoadedModel, expected_shapes
from kvcore.model_config import ModelConfig
from kvcore.tokenizer import Tokenizer

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

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# what a damaged or foreign file makes the gguf reader raise (it has no exception type of its own)
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per metadata value, and every slice of a memmap
    subclass pays for ``__array_finalize__``: ~100k slices for a 49k-token vocabulary took 6-8 s.
    A plain ndarray view of the same mapping makes that ~1 s. The base class assigns ``self.data``
    in ``__init__``; this property intercepts that assignment.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def _open(path: Path) -> tuple[_Reader, dict[str, Any]]:
    """The reader and its metadata as Python values; ModelLoadError for anything unreadable."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file '{path}' not found")
    try:
        reader = _Reader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except _READER_ERRORS as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ModelLoadError(f"'{path}' is not a valid GGUF file (truncated or corrupt?): {detail}") from None
    return reader, metadata


def _f32(value: float) -> float:
    # GGUF stores floats as float32, so 1e-5 comes back as 9.99999974e-06; the shortest decimal that
    # rounds to the same float32 is the value the model was configured with
    return float(str(np.float32(value)))


def _config(metadata: dict[str, Any], path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"'{path}': unsupported architecture '{arch}' (supported: llama)")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ModelLoadError(f"'{path}': GGUF metadata key 'llama.{key}' is missing")
        return value

    scaling = metadata.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"'{path}': unsupported rope scaling '{scaling}' (only plain RoPE is supported)")
    if metadata.get("llama.expert_count"):
        raise ModelLoadError(f"'{path}': unsupported: mixture-of-experts llama models")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length") or hidden // heads)
    value_dim = int(metadata.get("llama.attention.value_length") or head_dim)
    rope_dim = int(metadata.get("llama.rope.dimension_count") or head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ModelLoadError(
            f"'{path}': unsupported attention shape (key {head_dim}, value {value_dim}, rotary {rope_dim}"
            " dims); kvcore needs them equal"
        )
    vocab = metadata.get("llama.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=False,  # set by the caller, from whether output.weight exists
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=int(eos) if eos is not None else None,
    )


def _tokenizer(metadata: dict[str, Any], path: Path) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"'{path}': unsupported tokenizer model '{kind}' (supported: gpt2, i.e. byte-level BPE)"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelLoadError(f"'{path}': GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    bos, eos, pad = (metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    return Tokenizer.from_bpe_vocab(
        tokens,
        merges,
        token_types=metadata.get("tokenizer.ggml.token_type"),
        pre_tokenizer=metadata.get("tokenizer.ggml.pre"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=[int(eos)] if eos is not None else [],
        pad_token_id=int(pad) if pad is not None else None,
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _hf_name(name: str, path: Path) -> str:
    """Hugging Face name of GGUF tensor ``name``; ModelLoadError for tensors Llama does not have."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        if m.group(3) == "bias":
            raise ModelLoadError(
                f"'{path}': unsupported: tensor '{name}' is a bias (kvcore runs bias-free Llama)"
            )
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    if name == "rope_freqs.weight":
        raise ModelLoadError(f"'{path}': unsupported: rope_freqs (Llama 3.1-style rope scaling)")
    raise ModelLoadError(f"'{path}': unexpected tensor '{name}' for a llama model")


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
    out, inp = weight.shape
    return weight.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelLoadError(
            f"'{path}': tensor '{tensor.name}' has unsupported type {tensor.tensor_type.name} "
            f"(supported: {supported})"
        )
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except _READER_ERRORS as exc:
        raise ModelLoadError(f"'{path}': cannot decode tensor '{tensor.name}': {exc}") from None
    # [ne1, ne0] in numpy order is Hugging Face's [out, in]
    return values.reshape(tuple(int(n) for n in reversed(tensor.shape)))


def load_gguf(path: str | os.PathLike[str], name: str | None = None) -> LoadedModel:
    """Load a llama-architecture GGUF file: config, float32 weights (HF names/layout), tokenizer.

    Args:
        path: the ``.gguf`` file.
        name: display name; defaults to the file name without ``.gguf``.
    """
    path = Path(path)
    reader, metadata = _open(path)
    config = _checked(_config, metadata, path)
    tokenizer = _checked(_tokenizer, metadata, path)

    by_name = {}
    for tensor in reader.tensors:
        by_name[_hf_name(tensor.name, path)] = tensor
    tied = "lm_head.weight" not in by_name
    config = dataclasses.replace(config, tie_word_embeddings=tied)

    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in by_name]
    if missing:
        raise ModelLoadError(f"'{path}': missing tensor for '{missing[0]}' ({len(missing)} missing in all)")
    for hf_name, tensor in by_name.items():
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if hf_name not in shapes:
            raise ModelLoadError(f"'{path}': unexpected tensor '{tensor.name}'")
        if shape != shapes[hf_name]:
            raise ModelLoadError(
                f"'{path}': tensor '{tensor.name}' ({hf_name}) has shape {list(shape)}, "
                f"expected {list(shapes[hf_name])} from the metadata"
            )

    weights: dict[str, torch.Tensor] = {}
    for hf_name in shapes:  # Hugging Face order: embeddings, layer by layer, norm, head
        tensor = by_name[hf_name]
        values = _dequantize(tensor, path)
        if hf_name.endswith("q_proj.weight"):
            values = unpermute_qk(values, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            values = unpermute_qk(values, config.num_key_value_heads)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors are views of the read-only file mapping: copy them out
            values = values.copy()
        weights[hf_name] = torch.from_numpy(values)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(path),
        name=name or path.name.removesuffix(".gguf"),
    )


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads metadata, no tensor data)."""
    path = Path(path)
    _, metadata = _open(path)
    return _checked(_tokenizer, metadata, path)


def _checked(build: Callable[[dict[str, Any], Path], T], metadata: dict[str, Any], path: Path) -> T:
    """``build(metadata, path)``, with a metadata value of the wrong type reported as ModelLoadError."""
    try:
        return build(metadata, path)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"'{path}': malformed GGUF metadata: {exc}") from None
