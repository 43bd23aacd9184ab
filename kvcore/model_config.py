"""Architecture hyper-parameters of a Llama-family decoder."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.errors import ModelLoadError

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU).

    Field names follow Hugging Face's ``LlamaConfig`` where one exists.
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
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

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
