"""Architecture hyper-parameters of a Llama-family decoder, and the options of the one decoder kvcore runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcore.errors import ConfigError, ModelLoadError
from kvcore.model.rope import RopeScaling

__all__ = [
    "ModelConfig", "SIZE_LIMITS", "MAX_PARAMETERS", "checked_size", "checked_number", "checked_int",
    "DEFAULT_MAX_MODEL_LEN", "check_max_model_len",
]

#: upper bound of each size field: far above any released checkpoint (vocabularies ~256k, widths ~16k,
#: ~130 layers, 128 heads, head_dim 256), low enough that a hostile value fails before anything is sized by it
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 31,
}
#: upper bound of the parameter count a config implies (4 T)
MAX_PARAMETERS = 1 << 42


def checked_size(name: str, value: object, where: str = "model config", limit: str | None = None) -> int:
    """``value`` as a size field ``name``: an integer in ``1 .. SIZE_LIMITS[limit or name]``; ModelLoadError
    naming ``where`` and the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{where}: {name} must be a positive integer, got {_short(value)}")
    if value > SIZE_LIMITS[limit or name]:
        raise ModelLoadError(f"{where}: {name} = {value} is beyond kvcore's limit of {SIZE_LIMITS[limit or name]}")
    return value


def checked_number(name: str, value: object, where: str = "model config", positive: bool = True) -> float:
    """``value`` as a finite float (``> 0`` when ``positive``); ModelLoadError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"{where}: {name} must be a finite number, got {_short(value)}")
    if positive and value <= 0:
        raise ModelLoadError(f"{where}: {name} must be > 0, got {value!r}")
    return float(value)


def checked_int(name: str, value: object, where: str, lo: int, hi: int) -> int:
    """``value`` as an integer in ``lo .. hi`` (JSON's ``Infinity``, a float, a string: ModelLoadError naming
    ``where``, the field and the range)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelLoadError(f"{where}: {name} must be an integer in [{lo}, {hi}], got {value!r:.60}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA, gated MLP) and the options by which the
    families differ; the defaults are plain Llama's.

    Field names follow Hugging Face's configs where one exists. The architecture declarations
    (:mod:`kvcore.model.architectures`) fill them from ``config.json`` or GGUF metadata.
    """

    vocab_size: int
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int  # query heads H
    num_key_value_heads: int  # KV heads H_kv (H % H_kv == 0; GQA group = H // H_kv)
    head_dim: int  # d_h
    max_position_embeddings: int  # context window in tokens
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "llama"
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # Q/K/V projections have biases (Qwen2; Llama's attention_bias)
    attention_output_bias: bool = False  # the output projection has one (Llama's attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (Qwen3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma stores w - 1
    embedding_multiplier: float | None = None  # embeddings scaled by this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # gate activation: "silu" or "gelu_pytorch_tanh"
    sandwich_norms: bool = False  # extra RMSNorms after attention and after the MLP (Gemma 2)
    query_pre_attn_scalar: float | None = None  # softmax scale is this ** -0.5 (Gemma 2); None: head_dim
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None  # the same on attention scores (needs backend support)
    sliding_window: int | None = None  # keys a query may see on windowed layers (None: no window)
    sliding_window_layers: tuple[int, ...] | None = None  # layers that use the window; None: all of them
    rope_local_base_freq: float | None = None  # RoPE base of the windowed layers (Gemma 3); None: rope_theta

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            checked_size(name, getattr(self, name))
        checked_number("rms_norm_eps", self.rms_norm_eps)
        checked_number("rope_theta", self.rope_theta)
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        checked_number("norm_offset", self.norm_offset, positive=False)
        optional = ("embedding_multiplier", "query_pre_attn_scalar", "final_logit_softcapping",
                    "attn_logit_softcapping", "rope_local_base_freq")
        for name in optional:
            if getattr(self, name) is not None:
                checked_number(name, getattr(self, name))
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ModelLoadError(f"model config: sliding_window must be a positive integer, got {_short(window)}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and (
                    isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size
                ):
                    raise ModelLoadError(
                        f"model config: {name} {_short(token)} is not a token id (0 to {self.vocab_size - 1})"
                    )
        if self.num_parameters() > MAX_PARAMETERS:
            raise ModelLoadError(
                f"model config: the sizes imply {self.num_parameters()} parameters (limit {MAX_PARAMETERS})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(
                f"model config: unsupported hidden_act '{self.hidden_act}' (supported: silu, gelu_pytorch_tanh)"
            )

    def num_parameters(self) -> int:
        """Parameters the sizes imply (embeddings, head and the layers' projections; norms and biases left
        out): what a config promises before any tensor is read."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = d * (2 * q + 2 * kv) + 3 * d * self.intermediate_size
        return self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to the whole sequence)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size H // H_kv (1 = MHA, H = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV bytes one token occupies: 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element


#: the context kvcore serves when max_model_len is not given (capped at the model's own window)
DEFAULT_MAX_MODEL_LEN = 4096


def check_max_model_len(max_model_len: int | None, window: int) -> None:
    if max_model_len is not None and max_model_len > window:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context window of {window} tokens; "
                          f"use at most {window}")
