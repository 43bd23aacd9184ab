"""What every loader produces (:class:`LoadedModel`) and the shape checks they share."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvcore.errors import ModelLoadError
from kvcore.model.config import ModelConfig
from kvcore.text.tokenizer import Tokenizer

__all__ = ["LoadedModel", "expected_shapes", "stored_tensors", "split_rows", "check_layer_count"]


@dataclass
class LoadedModel:
    """A model ready for a backend to run.

    ``weights`` holds kvcore's canonical names (:func:`expected_shapes`: Hugging Face ``LlamaForCausalLM``'s
    plus the optional biases and norms other families have); linear weights are ``[out, in]``:
    ``model.embed_tokens.weight`` [V, d], ``model.layers.{i}.self_attn.q_proj.weight`` [H*d_h, d],
    ``k_proj``/``v_proj`` [H_kv*d_h, d], ``o_proj`` [d, H*d_h], ``mlp.gate_proj``/``up_proj`` [I, d],
    ``down_proj`` [d, I], the norms [d], and ``lm_head.weight`` [V, d] only when the embeddings are not
    tied. Q/K rows follow Hugging Face's rotate-half RoPE convention. Loaded with ``keep_quantized``, a GGUF's
    Q4_0/Q4_1 layer weights are :class:`~kvcore.loaders.gguf_blocks.GGUFBlocks` (same shapes) instead.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # file or directory it was loaded from
    name: str  # short display name


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a decoder with ``config`` has, by kvcore's canonical (Hugging Face Llama) name, with
    its shape: Llama's, plus Q/K/V biases (``attention_bias``), the output projection's bias
    (``attention_output_bias``), ``self_attn.{q,k}_norm.weight`` [D]
    (``qk_norm``) and, with ``sandwich_norms``, Gemma 2's ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` (its ``post_attention_layernorm`` then follows attention)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out = config.num_attention_heads * hd
    kv_out = config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, d)
            if config.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        if config.attention_output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
            shapes[p + "post_feedforward_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def check_layer_count(config: ModelConfig, names: Iterable[str], layer_prefix: str, where: str) -> None:
    """The layers the file's tensor names number (``layer_prefix`` with ``{i}``, e.g. ``blk.{i}.``) must be
    ``0 .. num_hidden_layers - 1``: the config is compared with the file before per-layer tables are built
    from it, so a layer count the file does not back fails with one line naming both.
    """
    head, _, tail = layer_prefix.partition("{i}")
    pattern = re.compile(re.escape(head) + r"(\d{1,9})" + re.escape(tail))
    found = {int(m.group(1)) for m in map(pattern.match, names) if m}
    expected = config.num_hidden_layers
    if found != set(range(expected)):
        extra = sorted(found - set(range(expected)))
        detail = f"layer {extra[0]} is beyond them" if extra else f"only {len(found)} of them have tensors"
        raise ModelLoadError(f"{where}: the config declares {expected} layers but {detail}")


def stored_tensors(
    shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    layer_names: dict[str, tuple[str, ...]],
    layer_prefix: str = "model.layers.{i}.",
    global_names: dict[str, str] | None = None,
) -> dict[str, list[str]]:
    """Tensor names a file stores -> the canonical names each holds (stacked along dim 0).

    :param layer_names: the family's per-layer file names (no ``.weight``/``.bias``) -> canonical names
        (relative to ``model.layers.{i}.``); :meth:`kvcore.model.architectures.Architecture.layer_names`.
    :param layer_prefix: how the file prefixes layer ``i``'s tensors (``blk.{i}.`` in GGUF).
    :param global_names: canonical -> file name of the tensors outside the layers.
    A canonical tensor nothing covers is stored under its own name.
    """
    stored: dict[str, list[str]] = {}
    covered: set[str] = set()
    for canonical, file_name in (global_names or {}).items():
        if canonical in shapes:
            stored[file_name] = [canonical]
            covered.add(canonical)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for file_name, parts in layer_names.items():
            for suffix in (".weight", ".bias"):
                names = [prefix + part + suffix for part in parts]
                if all(n in shapes for n in names):
                    stored[layer_prefix.format(i=i) + file_name + suffix] = names
                    covered.update(names)
    for name in shapes:
        if name not in covered:
            stored[name] = [name]
    return stored


def split_rows(tensor, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict:
    """A stored (possibly fused) tensor cut along dim 0 into its canonical tensors."""
    if len(names) == 1:
        return {names[0]: tensor}
    parts = tensor.split([shapes[n][0] for n in names], 0)
    return {n: part for n, part in zip(names, parts)}
