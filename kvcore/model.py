"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) that calls a pluggable attention backend.

Tensors are packed: a forward call carries ``T`` tokens from ``B`` sequences (see
:class:`~kvcore.attention.AttentionMetadata`). Q/K/V and gate/up projections are fused into one
matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.attention import AttentionBackend, AttentionMetadata
from kvcore.errors import ModelLoadError
from kvcore.kv_cache import KVCache
from kvcore.model_config import ModelConfig

__all__ = ["LlamaModel", "RotaryEmbedding", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight``, the statistics in float32 (as Hugging Face Llama does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" layout: dims ``[0, D/2)`` pair with ``[D/2, D)``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
        angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [P, D/2] float32
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` by the angles of ``positions`` ``[T]``."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]  # [T, 1, D/2]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)  # [T, heads, D/2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel(nn.Module):
    """Decoder weights plus the forward pass. Build it with :meth:`from_weights`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = config
        self.config = c
        q_size = c.num_attention_heads * c.head_dim
        kv_size = c.num_key_value_heads * c.head_dim
        self.q_size, self.kv_size = q_size, kv_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.embed_tokens = empty(c.vocab_size, c.hidden_size)  # [V, d]
        self.input_norm = nn.ParameterList(empty(c.hidden_size) for _ in range(c.num_hidden_layers))
        self.qkv_proj = nn.ParameterList(  # [(H + 2 H_kv) D, d]
            empty(q_size + 2 * kv_size, c.hidden_size) for _ in range(c.num_hidden_layers)
        )
        self.o_proj = nn.ParameterList(empty(c.hidden_size, q_size) for _ in range(c.num_hidden_layers))
        self.post_norm = nn.ParameterList(empty(c.hidden_size) for _ in range(c.num_hidden_layers))
        self.gate_up_proj = nn.ParameterList(  # [2 I, d]
            empty(2 * c.intermediate_size, c.hidden_size) for _ in range(c.num_hidden_layers)
        )
        self.down_proj = nn.ParameterList(empty(c.hidden_size, c.intermediate_size) for _ in range(c.num_hidden_layers))
        self.norm = empty(c.hidden_size)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else empty(c.vocab_size, c.hidden_size)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @classmethod
    def from_weights(
        cls, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> LlamaModel:
        """Build from Hugging Face Llama parameter names (``model.layers.0.self_attn.q_proj.weight``...)."""
        model = cls(config, dtype)

        def take(name: str) -> torch.Tensor:
            try:
                return weights[name]
            except KeyError:
                raise ModelLoadError(f"model weights lack '{name}'") from None

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"weight '{name}' has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.copy_(value.to(dtype))

        with torch.no_grad():
            put(model.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
            put(model.norm, take("model.norm.weight"), "model.norm.weight")
            if not config.tie_word_embeddings:
                put(model.lm_head, take("lm_head.weight"), "lm_head.weight")
            for i in range(config.num_hidden_layers):
                p = f"model.layers.{i}."
                attn = [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
                put(model.qkv_proj[i], torch.cat(attn, 0), p + "self_attn.{q,k,v}_proj.weight")
                put(model.o_proj[i], take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
                mlp = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
                put(model.gate_up_proj[i], torch.cat(mlp, 0), p + "mlp.{gate,up}_proj.weight")
                put(model.down_proj[i], take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
                put(model.input_norm[i], take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
                post = p + "post_attention_layernorm.weight"
                put(model.post_norm[i], take(post), post)
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Run the decoder over packed tokens; writes their K/V into ``cache``.

        :param input_ids: ``[T]`` int64 token ids, packed as ``meta`` describes.
        :returns: ``[T, d]`` final hidden states (after the last RMSNorm).
        """
        c = self.config
        num_tokens = input_ids.shape[0]
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed_tokens)  # (T, d)
        for i in range(c.num_hidden_layers):
            x = rms_norm(h, self.input_norm[i], eps)
            qkv = F.linear(x, self.qkv_proj[i])  # (T, (H + 2 H_kv) D)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rotary(q.view(num_tokens, c.num_attention_heads, c.head_dim), meta.positions)  # (T, H, D)
            k = self.rotary(k.view(num_tokens, c.num_key_value_heads, c.head_dim), meta.positions)  # (T, H_kv, D)
            v = v.view(num_tokens, c.num_key_value_heads, c.head_dim)  # (T, H_kv, D)
            attn = backend.forward(i, q, k, v, cache, meta)  # (T, H, D)
            h = h + F.linear(attn.reshape(num_tokens, self.q_size), self.o_proj[i])
            x = rms_norm(h, self.post_norm[i], eps)
            gate, up = F.linear(x, self.gate_up_proj[i]).chunk(2, dim=-1)  # (T, I) each
            h = h + F.linear(F.silu(gate) * up, self.down_proj[i])
        return rms_norm(h, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d]`` hidden states → ``[N, V]`` float32 logits."""
        return F.linear(hidden, self.lm_head).float()
