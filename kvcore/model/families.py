"""The built-in architectures (registered through ``kvcore_register_architectures``, as a plugin's would be)
and the ``kvcore models`` command that lists them.

Each class is the whole difference between its family and plain Llama; see :mod:`kvcore.model.architectures`.
"""

from __future__ import annotations

import math
from typing import Any

from kvcore.errors import ModelLoadError
from kvcore.hookspecs import hookimpl
from kvcore.model.architectures import Architecture, layer_types_window, window_size
from kvcore.model.config import SIZE_LIMITS, checked_int, checked_number

__all__ = ["Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma2", "Gemma3", "BUILTIN_ARCHITECTURES", "MAX_PATTERN"]

#: the largest Gemma 3 ``sliding_window_pattern`` (every n-th layer global): no model has more layers
MAX_PATTERN = SIZE_LIMITS["num_hidden_layers"]


class Llama(Architecture):
    name = "llama"
    description = "Llama 1/2/3/3.1/3.2, SmolLM, TinyLlama... (RoPE scaling: linear, dynamic, llama3, yarn)"
    hf_architectures = ("LlamaForCausalLM",)
    hf_model_types = ("llama",)
    gguf_arch = "llama"
    gguf_permute_qk = True

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("attention_bias", False))  # transformers' Llama: on all four projections
        return {"attention_bias": bias, "attention_output_bias": bias}


class Mistral(Llama):
    name = "mistral"
    description = "Mistral 7B v0.1-v0.3 (sliding window); GGUF files say 'llama'"
    hf_architectures = ("MistralForCausalLM",)
    hf_model_types = ("mistral",)
    gguf_arch = None  # llama.cpp's converter writes Mistral as "llama"
    attention_features = ("sliding_window",)

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_options(cfg), **layer_types_window(cfg, default_all=True)}


class Qwen2(Architecture):
    name = "qwen2"
    description = "Qwen2, Qwen2.5 (Q/K/V biases)"
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_model_types = ("qwen2",)
    gguf_arch = "qwen2"
    options = {"attention_bias": True}
    attention_features = ("sliding_window",)  # use_sliding_window: layers from max_window_layers on

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        if not cfg.get("use_sliding_window"):
            return {}
        window = layer_types_window(cfg, default_all=False)
        if window or not cfg.get("sliding_window"):
            return window
        # transformers: layers from max_window_layers on slide (at or above the layer count: none)
        first = checked_int("max_window_layers", cfg.get("max_window_layers") or 0, "config.json", 0,
                            SIZE_LIMITS["num_hidden_layers"])
        return {"sliding_window": window_size(cfg["sliding_window"]),
                "sliding_window_layers": tuple(range(first, int(cfg["num_hidden_layers"])))}


class Qwen3(Qwen2):
    name = "qwen3"
    description = "Qwen3 dense (per-head Q/K RMSNorm)"
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_types = ("qwen3",)
    gguf_arch = "qwen3"
    options = {"qk_norm": True}

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().hf_options(cfg), "attention_bias": bool(cfg.get("attention_bias", False))}


class Phi3(Architecture):
    name = "phi3"
    description = "Phi-3 / Phi-3.5 mini (fused QKV and gate-up weights, longrope)"
    hf_architectures = ("Phi3ForCausalLM",)
    hf_model_types = ("phi3",)
    gguf_arch = "phi3"
    hf_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    attention_features = ("sliding_window",)
    hf_fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    gguf_fused = {
        "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),  # llama.cpp keeps Phi-3's gate_up_proj whole as ffn_up
    }

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return layer_types_window(cfg, default_all=True)

    @classmethod
    def gguf_options(cls, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        window = meta.get("attention.sliding_window")
        return {"sliding_window": int(window)} if window else {}


class Gemma2(Architecture):
    name = "gemma2"
    description = "Gemma 2 (1 + w norms, sandwich norms, GeLU-tanh, logit soft-capping, alternating windows)"
    hf_architectures = ("Gemma2ForCausalLM",)
    hf_model_types = ("gemma2",)
    gguf_arch = "gemma2"
    hf_defaults = {"tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    options = {"norm_offset": 1.0, "sandwich_norms": True, "hidden_act": "gelu_pytorch_tanh"}
    gguf_names = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    gguf_norm_offset_baked = True
    attention_features = ("sliding_window", "softcap")

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return _gemma_hf_options(cfg, cfg.get("layer_types"))

    @classmethod
    def gguf_options(cls, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        return _gemma_gguf_options(meta, config, big_layers=46, layer_types=None)  # 27B: 46 layers


class Gemma3(Architecture):
    name = "gemma3"
    description = ("Gemma 3 text (local/global layers 5:1 with two RoPE bases, QK-norm, sandwich norms, "
                   "scaled embeddings)")
    hf_architectures = ("Gemma3ForCausalLM",)
    hf_model_types = ("gemma3_text",)
    gguf_arch = "gemma3"
    hf_defaults = {"tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    options = {"norm_offset": 1.0, "sandwich_norms": True, "qk_norm": True, "hidden_act": "gelu_pytorch_tanh"}
    gguf_names = Gemma2.gguf_names
    gguf_norm_offset_baked = True
    attention_features = ("sliding_window",)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any], eos: Any, where: str):
        # transformers >= 5 nests rope_parameters per layer type: the common reader takes the global layers'
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            local = rope.get("sliding_attention") or {}
            if not isinstance(local, dict):
                raise ModelLoadError(f"'{where}': config.json: rope_parameters.sliding_attention must be an object, "
                                     f"got {type(local).__name__}")
            cfg = {**cfg, "rope_parameters": rope["full_attention"],
                   "rope_local_base_freq": local.get("rope_theta", cfg.get("rope_local_base_freq"))}
        return super().config_from_hf(cfg, eos, where)

    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        layers = int(cfg["num_hidden_layers"])
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or _every_nth_global(
            checked_int("sliding_window_pattern", pattern, "config.json", 1, MAX_PATTERN), layers)
        local_base = cfg.get("rope_local_base_freq", 10000.0)
        return {**_gemma_hf_options(cfg, types),
                "rope_local_base_freq": checked_number("rope_local_base_freq", local_base, "config.json")}

    @classmethod
    def gguf_options(cls, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        layers = config["num_hidden_layers"]
        return {
            **_gemma_gguf_options(meta, config, big_layers=62, layer_types=_every_nth_global(6, layers)),  # 27B
            # llama.cpp's default when the file does not say: local layers rotate with base 10000
            "rope_local_base_freq": checked_number("rope_local_base_freq", meta.get("rope.freq_base_swa", 10000.0),
                                                   "GGUF metadata 'gemma3.rope.freq_base_swa'"),
        }


def _gemma_hf_options(cfg: dict[str, Any], layer_types: list[str] | None) -> dict[str, Any]:
    """What Gemma 2 and 3 Hugging Face configs share (see :func:`_gemma_gguf_options`)."""
    return {
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "embedding_multiplier": math.sqrt(cfg["hidden_size"]),
        "query_pre_attn_scalar": checked_number("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", 256),
                                                "config.json"),
        **_softcaps(cfg, "config.json"),
        **_alternating(cfg.get("sliding_window"), layer_types, int(cfg["num_hidden_layers"]), "config.json"),
    }


def _softcaps(values: dict[str, Any], where: str) -> dict[str, Any]:
    """The logit soft-caps a Gemma config sets: each absent (or null: off) or a finite number > 0 (a cap of 0
    divides by zero, a negative one turns the logits upside down)."""
    keys = ("final_logit_softcapping", "attn_logit_softcapping")
    return {key: checked_number(key, values[key], where) for key in keys if values.get(key) is not None}


def _gemma_gguf_options(meta: dict[str, Any], config: dict[str, Any], big_layers: int,
                        layer_types: list[str] | None) -> dict[str, Any]:
    """What Gemma 2 and 3 GGUF files share: scaled embeddings, the query scale, soft-caps, windows on the layers
    ``layer_types`` marks (None: every even layer). llama.cpp scales queries by 1/sqrt(head_dim), except in the
    27B models (``big_layers`` layers), where it uses 1/sqrt(hidden / heads)."""
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    scalar = hidden // heads if layers == big_layers else config["head_dim"]
    return {
        "embedding_multiplier": math.sqrt(hidden),
        "query_pre_attn_scalar": float(scalar),
        **_softcaps(meta, "GGUF metadata"),
        **_alternating(meta.get("attention.sliding_window"), layer_types, layers, "GGUF metadata"),
    }


def _every_nth_global(pattern: int, layers: int) -> list[str]:
    """Gemma 3's layer types: every ``pattern``-th layer global, the others local (five local : one global)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def _alternating(window: object, layer_types: list[str] | None, layers: int, where: str) -> dict[str, Any]:
    """Gemma's windows: on the layers ``layer_types`` marks, else every even layer (0, 2, ...; Gemma 2)."""
    if not window:
        return {}
    window = window_size(window, where)
    if layer_types:
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:
        sliding = tuple(range(0, layers, 2))
    return {"sliding_window": window, "sliding_window_layers": sliding}


BUILTIN_ARCHITECTURES = (Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, Gemma3)


@hookimpl
def kvcore_register_architectures(register):
    for arch in BUILTIN_ARCHITECTURES:
        register(arch)
