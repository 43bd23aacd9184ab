"""Model loading: turn a model spec into a config, float32 weights and a tokenizer.

A spec is ``"smollm2"`` (the embedded default, SmolLM2-135M-Instruct), a ``.gguf`` file, or a
Hugging Face model directory. Every loader produces the same :class:`LoadedModel`: weights under
Hugging Face ``LlamaForCausalLM`` parameter names, in Hugging Face's layout, as float32 CPU tensors,
so the rest of kvcore never needs to know where a model came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.model_config import ModelConfig
from kvcore.tokenizer import Tokenizer

__all__ = ["LoadedModel", "load_model", "expected_shapes", "DEFAULT_MODEL"]

#: the spec :func:`load_model` uses when given none
DEFAULT_MODEL = "smollm2"


@dataclass
class LoadedModel:
    """A model ready for a backend to run.

    ``weights`` holds Hugging Face ``LlamaForCausalLM`` names; linear weights are ``[out, in]``:
    ``model.embed_tokens.weight`` [V, d], ``model.layers.{i}.self_attn.q_proj.weight`` [H*d_h, d],
    ``k_proj``/``v_proj`` [H_kv*d_h, d], ``o_proj`` [d, H*d_h], ``mlp.gate_proj``/``up_proj`` [I, d],
    ``down_proj`` [d, I], the norms [d], and ``lm_head.weight`` [V, d] only when the embeddings are not
    tied. Q/K rows follow Hugging Face's rotate-half RoPE convention.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # file or directory it was loaded from
    name: str  # short display name


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama model with ``config`` has, by Hugging Face name, with its shape."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out = config.num_attention_heads * hd
    kv_out = config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def load_model(spec: str = DEFAULT_MODEL) -> LoadedModel:
    """Load ``spec``: ``"smollm2"``, a path to a ``.gguf`` file, or a Hugging Face model directory.

    Raises ModelNotFoundError when ``spec`` names nothing loadable, ModelLoadError when the files are
    broken or describe a model kvcore cannot run.
    """
    # loaders are imported here, not at the top, so `import kvcore.loaders` stays light and each
    # loader module can import LoadedModel from this package without a cycle
    spec = str(spec)  # tolerate a pathlib.Path
    if spec.strip().lower() == DEFAULT_MODEL:
        from kvcore.loaders.gguf import load_gguf
        from kvcore.loaders.resolve import SMOLLM2_DISPLAY_NAME, smollm2_path

        return load_gguf(smollm2_path(), name=SMOLLM2_DISPLAY_NAME)

    hint = "give 'smollm2', a .gguf file or a Hugging Face model directory"
    if not spec.strip():
        raise ModelNotFoundError(f"no model given: {hint}")
    path = Path(spec).expanduser()
    if path.is_dir():
        from kvcore.loaders.hf import load_hf_dir

        return load_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            from kvcore.loaders.gguf import load_gguf

            return load_gguf(path)
        raise ModelNotFoundError(f"model '{spec}' is neither a .gguf file nor a model directory: {hint}")
    raise ModelNotFoundError(f"model '{spec}' not found: {hint}")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc.strerror or exc}") from None
