"""Megatron-style weight sharding of a :class:`~kvcore.model.decoder.LlamaModel` into rank-local models.

Per layer, rank ``r`` holds:

- ``qkv_proj`` (column-parallel): the rows of its query heads and of its KV heads (Q, K and V stay fused);
- ``o_proj`` (row-parallel): the columns of its query heads; the partial outputs are summed across ranks;
- ``gate_up_proj`` (column-parallel): rows ``[f0, f1)`` of gate and of up (SwiGLU is elementwise per row);
- ``down_proj`` (row-parallel): columns ``[f0, f1)``; partial outputs summed across ranks.

Embeddings, norms and the LM head are replicated (the LM head only where logits are computed: rank 0).
A rank-local model is an ordinary ``LlamaModel`` whose config has the local head counts and FFN width,
so every attention backend and KV-cache layout runs on it unchanged: they only ever see local heads.

Head split (:func:`plan_shards`): by whole GQA groups. With ``H_kv >= N`` the KV heads are dealt out in
contiguous runs, the first ``H_kv % N`` ranks taking one more (uneven, never splitting a group: SmolLM2's
3 KV heads over 2 ranks → rank 0 holds KV heads 0, 1 = query heads 0..5, rank 1 KV head 2 = query heads
6..8). With ``H_kv < N`` each KV head is replicated on ``N / H_kv`` ranks, which split its group's query
heads (needs ``N % H_kv == 0``); anything else is refused with a ConfigError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcore.errors import ConfigError
from kvcore.model.config import ModelConfig
from kvcore.model.decoder import LlamaModel

__all__ = ["RankShard", "plan_shards", "shard_state", "build_local_model", "local_config", "check_shardable"]


@dataclass(frozen=True)
class RankShard:
    """What one rank computes. Head indices are global; ``ffn`` is ``[start, stop)`` of the SwiGLU width."""

    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ffn: tuple[int, int]

    def as_dict(self) -> dict:
        return {"rank": self.rank, "q_heads": list(self.q_heads), "kv_heads": list(self.kv_heads),
                "ffn": list(self.ffn)}


def plan_shards(config: ModelConfig, world_size: int) -> list[RankShard]:
    """Split ``config``'s heads and FFN over ``world_size`` ranks (see the module doc), or raise ConfigError."""
    n, h, h_kv = world_size, config.num_attention_heads, config.num_key_value_heads
    group = h // h_kv  # query heads per KV head
    if h_kv >= n:
        counts = [h_kv // n + (1 if r < h_kv % n else 0) for r in range(n)]
        starts = [sum(counts[:r]) for r in range(n)]
        kv = [tuple(range(s, s + c)) for s, c in zip(starts, counts)]
        q = [tuple(range(k[0] * group, (k[-1] + 1) * group)) for k in kv]
    elif n % h_kv == 0 and h % n == 0:
        replicas, per_rank = n // h_kv, h // n
        kv = [(r // replicas,) for r in range(n)]
        q = [tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(n)]
    else:
        raise ConfigError(
            f"tensor_parallel_size {n} does not fit this model's heads: {h} query heads over {h_kv} KV heads "
            f"split by whole GQA groups needs tensor_parallel_size <= {h_kv}, or a multiple of {h_kv} that "
            f"divides {h} (KV heads replicated)"
        )
    width = config.intermediate_size
    if width < n:
        raise ConfigError(f"tensor_parallel_size {n} exceeds the FFN width ({width})")
    return [RankShard(r, q[r], kv[r], (r * width // n, (r + 1) * width // n)) for r in range(n)]


def local_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config of the rank-local model: local head counts and FFN width, everything else as is."""
    return dataclasses.replace(
        config,
        num_attention_heads=len(shard.q_heads),
        num_key_value_heads=len(shard.kv_heads),
        intermediate_size=shard.ffn[1] - shard.ffn[0],
    )


def _head_rows(heads: tuple[int, ...], head_dim: int, offset: int = 0) -> torch.Tensor:
    """Row indices ``[len(heads) * head_dim]`` of ``heads`` in a projection whose head blocks start at ``offset``."""
    return (offset + torch.tensor(heads)[:, None] * head_dim + torch.arange(head_dim)[None, :]).flatten()


#: per-layer weights every rank holds whole: norms (of the full hidden state, or per head dim for Q/K norms)
#: and the output-projection bias, added once to the all-reduced sum
REPLICATED_PER_LAYER = ("input_norm", "post_norm", "q_norm", "k_norm", "o_bias", "post_attn_norm", "post_mlp_norm")


def check_shardable(model: torch.nn.Module) -> None:
    """ConfigError unless ``model`` is a dense-weight LlamaModel (what :func:`shard_state` can split)."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_norm", "post_norm", "embed_tokens", "norm")
    if not isinstance(model, LlamaModel) or not all(hasattr(model, n) for n in names):
        raise ConfigError(
            f"tensor parallelism shards the Llama layout (fused qkv_proj/gate_up_proj); {type(model).__name__} "
            "is not supported"
        )
    if getattr(model, "weight_format", "float") != "float":
        raise ConfigError(
            f"tensor parallelism shards dense weights; this model's are {model.weight_format}: use weights "
            "'float' (--weights float) with tensor_parallel_size > 1"
        )


def shard_state(model: LlamaModel, shard: RankShard, with_lm_head: bool) -> dict[str, torch.Tensor]:
    """The rank's weights by name (``qkv_proj.3``, ``embed_tokens``...). Sliced weights are new contiguous
    tensors; replicated ones are the model's own tensors (no copy)."""
    check_shardable(model)
    c = model.config
    d, h, h_kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q_rows = _head_rows(shard.q_heads, d)
    qkv_rows = torch.cat([q_rows, _head_rows(shard.kv_heads, d, h * d), _head_rows(shard.kv_heads, d, (h + h_kv) * d)])
    f0, f1 = shard.ffn
    ffn_rows = torch.cat([torch.arange(f0, f1), c.intermediate_size + torch.arange(f0, f1)])
    state: dict[str, torch.Tensor] = {"embed_tokens": model.embed_tokens.detach(), "norm": model.norm.detach()}
    # the RoPE tables as the full model built them (a scaled scheme depends on the original window)
    state["rotary.cos"], state["rotary.sin"] = model.rotary.cos, model.rotary.sin
    if with_lm_head and not c.tie_word_embeddings:
        state["lm_head"] = model.lm_head.detach()
    for i in range(c.num_hidden_layers):
        for name in REPLICATED_PER_LAYER:  # norms and the output bias apply to the summed output: every rank
            plist = getattr(model, name)
            if plist is not None:
                state[f"{name}.{i}"] = plist[i].detach()
        if model.qkv_bias is not None:
            state[f"qkv_bias.{i}"] = model.qkv_bias[i].detach().index_select(0, qkv_rows).contiguous()
        state[f"qkv_proj.{i}"] = model.qkv_proj[i].detach().index_select(0, qkv_rows).contiguous()
        state[f"o_proj.{i}"] = model.o_proj[i].detach().index_select(1, q_rows).contiguous()
        state[f"gate_up_proj.{i}"] = model.gate_up_proj[i].detach().index_select(0, ffn_rows).contiguous()
        state[f"down_proj.{i}"] = model.down_proj[i].detach()[:, f0:f1].contiguous()
    return state


def build_local_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """A ``LlamaModel`` over ``state`` (from :func:`shard_state`) whose row-parallel outputs go through
    ``all_reduce``. Without ``lm_head`` in ``state`` (an untied head on a rank that computes no logits)
    the head is left empty."""
    dtype = state["embed_tokens"].dtype
    model = LlamaModel(config, dtype)
    tied = config.tie_word_embeddings
    with torch.no_grad():
        model.embed_tokens = torch.nn.Parameter(state["embed_tokens"], requires_grad=False)  # shared, no copy
        model.norm = torch.nn.Parameter(state["norm"], requires_grad=False)
        if tied:
            model.lm_head = model.embed_tokens
        elif "lm_head" in state:
            model.lm_head = torch.nn.Parameter(state["lm_head"], requires_grad=False)
        else:
            model.lm_head = torch.nn.Parameter(torch.empty(0, config.hidden_size, dtype=dtype), requires_grad=False)
        for name in (*REPLICATED_PER_LAYER, "qkv_bias", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            plist = getattr(model, name)
            if plist is None:
                continue
            for i in range(config.num_hidden_layers):
                plist[i] = torch.nn.Parameter(state[f"{name}.{i}"], requires_grad=False)
        model.rotary.cos, model.rotary.sin = state["rotary.cos"], state["rotary.sin"]
    model.all_reduce = all_reduce
    return model.to(device)  # .to() re-picks the weight layout (column-major on CPU float32)
