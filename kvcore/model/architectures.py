"""Model architectures: small declarations of how a family maps onto kvcore's one decoder.

An architecture is a subclass of :class:`Architecture` registered through the
``kvcore_register_architectures`` hook (the built-ins live in :mod:`kvcore.model.families`). It declares

* which checkpoints it reads: Hugging Face ``architectures`` / ``model_type`` names, GGUF ``general.architecture``;
* its decoder options (:attr:`Architecture.options`, fields of :class:`~kvcore.model.config.ModelConfig`) and
  how the variable ones are read from ``config.json`` (:meth:`Architecture.hf_options`) or GGUF metadata
  (:meth:`Architecture.gguf_options`);
* its weight names where they differ from kvcore's canonical (Hugging Face Llama) names: fused tensors
  (:attr:`Architecture.hf_fused`, :attr:`Architecture.gguf_fused`) and llama.cpp's names
  (:attr:`Architecture.gguf_names`).

Everything common (sizes, RoPE, special tokens) is read here, once, for every architecture.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from kvcore.errors import ModelLoadError
from kvcore.model.config import SIZE_LIMITS, ModelConfig, checked_int, checked_number, checked_size
from kvcore.model.rope import RopeScaling

__all__ = ["Architecture", "GGUF_LAYER_NAMES", "f32", "layer_types_window", "window_size"]

#: llama.cpp's per-layer tensor names -> kvcore's canonical names (``model.layers.{i}.`` + this)
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Architecture:
    """Declaration of one model family (see the module docstring). Class attributes only; never instantiated."""

    name: ClassVar[str]  # registry key, e.g. "qwen2"
    description: ClassVar[str] = ""
    hf_architectures: ClassVar[tuple[str, ...]] = ()  # config.json "architectures", e.g. "Qwen2ForCausalLM"
    hf_model_types: ClassVar[tuple[str, ...]] = ()  # config.json "model_type"
    gguf_arch: ClassVar[str | None] = None  # GGUF general.architecture
    #: ModelConfig fields every checkpoint of the family has (e.g. {"qk_norm": True})
    options: ClassVar[dict[str, Any]] = {}
    #: config.json defaults of the family's transformers config class, for keys a checkpoint may omit
    hf_defaults: ClassVar[dict[str, Any]] = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6}
    #: fused checkpoint tensors: layer-relative name -> the canonical names stacked along dim 0
    hf_fused: ClassVar[dict[str, tuple[str, ...]]] = {}
    gguf_fused: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: llama.cpp per-layer names that differ from :data:`GGUF_LAYER_NAMES` for this family
    gguf_names: ClassVar[dict[str, str]] = {}
    #: llama.cpp's converter interleaves each head's Q/K rows for its non-NeoX RoPE (the "llama" arch only)
    gguf_permute_qk: ClassVar[bool] = False
    #: llama.cpp's converter stores RMSNorm weights with the family's offset added (Gemma: 1 + w)
    gguf_norm_offset_baked: ClassVar[bool] = False
    #: attention variants (:data:`kvcore.interfaces.attention.VARIANTS`) the family's layers may use; ``kvcore models``
    #: lists the backends that serve them in both phases (the engine checks the loaded model's actual layers)
    attention_features: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def availability(cls) -> str | None:
        """None: declarations need nothing installed (the registry asks every plugin kind)."""
        return None

    # -- config.json -----------------------------------------------------------------------------------
    @classmethod
    def hf_options(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Family-specific ModelConfig fields read from ``config.json`` (the common ones are read for all)."""
        return {}

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any], eos: Any, where: str) -> ModelConfig:
        """The ModelConfig of a ``config.json`` dict; ``eos`` from generation_config.json when it has one."""
        cfg = {**cls.hf_defaults, **{k: v for k, v in cfg.items() if v is not None}}
        at = f"'{where}': config.json"

        def size(key: str, default: Any = None) -> int:
            # checked before anything (a family's per-layer option tuples included) is sized by it
            if key not in cfg and default is None:
                raise ModelLoadError(f"{at} has no '{key}'")
            value = cfg.get(key)
            return checked_size(key, value if value or default is None else default, at)

        hidden, heads, layers = size("hidden_size"), size("num_attention_heads"), size("num_hidden_layers")
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{at}: unsupported: mlp_bias is true (MLP biases)")
        rope: dict[str, Any] = {}  # transformers >= 5: rope_parameters; older files: rope_scaling + rope_theta
        for key in ("rope_parameters", "rope_scaling"):
            if not isinstance(cfg.get(key) or {}, dict):
                raise ModelLoadError(f"{at}: '{key}' must be an object, got {type(cfg[key]).__name__}")
            rope.update(cfg.get(key) or {})
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
            raise ModelLoadError(f"{at}: unsupported: partial_rotary_factor < 1 (partial RoPE)")
        scaling = hf_rope_scaling(rope, cfg, where)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        options = {"architecture": cls.name, "hidden_act": cfg.get("hidden_act", "silu")}
        options.update({**cls.options, **cls.hf_options(cfg)})
        return ModelConfig(
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", max(hidden // heads, 1)),
            max_position_embeddings=size("max_position_embeddings"),
            rms_norm_eps=checked_number("rms_norm_eps", cfg["rms_norm_eps"], at),
            rope_theta=checked_number("rope_theta", theta, at),
            rope_scaling=scaling,
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", at),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos if eos is not None else cfg.get("eos_token_id"),
            **options,
        )

    # -- GGUF metadata ---------------------------------------------------------------------------------
    @classmethod
    def gguf_options(cls, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Family-specific ModelConfig fields read from GGUF metadata (keys without the ``{arch}.`` prefix);
        ``config`` holds the common fields already read."""
        return {}

    @classmethod
    def layer_names(cls, fmt: str) -> dict[str, tuple[str, ...]]:
        """Per-layer tensor names (no ``.weight``/``.bias``) of a ``fmt`` ("hf" or "gguf") file -> the canonical
        names each holds, stacked along dim 0."""
        if fmt == "hf":
            return dict(cls.hf_fused)
        fused = {part for parts in cls.gguf_fused.values() for part in parts}  # stored only in the fused tensor
        names = {k: (v,) for k, v in {**GGUF_LAYER_NAMES, **cls.gguf_names}.items() if v not in fused}
        return {**names, **cls.gguf_fused}


def hf_rope_scaling(rope: dict[str, Any], cfg: dict[str, Any], where: str) -> RopeScaling | None:
    """A RopeScaling from Hugging Face's ``rope_scaling`` / ``rope_parameters`` dict (None for plain RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor"):
        if rope.get(key) is not None:
            checked_number(key, rope[key], f"'{where}': config.json rope scaling", positive=False)
    if original is not None:
        checked_size("original_max_position_embeddings", original, f"'{where}': config.json rope scaling",
                     limit="max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if values is not None and not (
            isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        ):
            raise ModelLoadError(f"'{where}': config.json rope scaling {key} must be a list of numbers")
    fields = {
        "factor": rope.get("factor"),
        "original_max_position_embeddings": original,
        "low_freq_factor": rope.get("low_freq_factor"),
        "high_freq_factor": rope.get("high_freq_factor"),
        "beta_fast": rope.get("beta_fast"),
        "beta_slow": rope.get("beta_slow"),
        "mscale": rope.get("mscale"),
        "mscale_all_dim": rope.get("mscale_all_dim"),
        "truncate": rope.get("truncate"),
        "attention_factor": rope.get("attention_factor"),
        "short_factor": tuple(rope["short_factor"]) if rope.get("short_factor") else None,
        "long_factor": tuple(rope["long_factor"]) if rope.get("long_factor") else None,
    }
    keep = {"mscale", "mscale_all_dim", "attention_factor", "short_factor", "long_factor"}
    fields = {k: v for k, v in fields.items() if v is not None or k in keep}
    if kind == "yarn" and "factor" not in fields:
        fields["factor"] = 0.0  # derived from the windows (see kvcore.model.rope)
    try:
        return RopeScaling(rope_type=kind, **fields)
    except ModelLoadError as exc:
        raise ModelLoadError(f"'{where}': {exc}") from None
    except TypeError as exc:
        raise ModelLoadError(f"'{where}': malformed rope scaling {rope!r}: {exc}") from None


def _flag(cfg: dict[str, Any], key: str, where: str) -> bool:
    """A config.json boolean; a string such as "no" must not silently read as true."""
    value = cfg[key]
    if not isinstance(value, bool):
        raise ModelLoadError(f"{where}: {key} must be true or false, got {value!r:.60}")
    return value


def layer_types_window(cfg: dict[str, Any], default_all: bool) -> dict[str, Any]:
    """``sliding_window`` / ``sliding_window_layers`` from a config.json: its ``layer_types`` list when
    there is one, else every layer (``default_all``) or none."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    types = cfg.get("layer_types")
    if types:
        return {"sliding_window": window_size(window), "sliding_window_layers": tuple(
            i for i, t in enumerate(types) if t == "sliding_attention"
        )}
    return {"sliding_window": window_size(window)} if default_all else {}


def window_size(window: object, where: str = "config.json") -> int:
    """A ``sliding_window``: an integer in 1 .. the largest context kvcore takes (``Infinity``, ``4096.5`` or
    ``"4k"``: ModelLoadError naming the key and the range, not an internal error)."""
    return checked_int("sliding_window", window, where, 1, SIZE_LIMITS["max_position_embeddings"])


def f32(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 comes back as 9.99999974e-06): the shortest decimal that
    rounds to the same float32 is the value the model was configured with."""
    return float(str(np.float32(value)))
