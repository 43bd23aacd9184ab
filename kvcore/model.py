"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) that calls a pluggable attention backend.

Tensors are packed: a forward call carries ``T`` tokens from ``B`` sequences (see
:class:`~kvcore.attention.AttentionMetadata`). Q/K/V and gate/up projections are fused into one
matmul each. The model knows nothing of caches or backends: it calls the ``attention`` it is handed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.errors import ModelLoadError
from kvcore.model_config import ModelConfig

__all__ = ["LlamaModel", "RotaryEmbedding", "rms_norm", "Attention"]

#: ``attention(layer_idx, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> [T, H, D]``: stores this call's
#: K/V and attends (a backend bound to its cache and plan by the model runner)
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight``, the statistics in float32 (as Hugging Face Llama does)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # a new tensor
    if weight.dtype != normed.dtype:
        return weight * normed  # type promotion
    return normed.mul_(weight)  # in place (no allocation): same values as ``weight * normed``


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" layout: dims ``[0, D/2)`` pair with ``[D/2, D)``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
        angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [P, D/2] float32
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width ``cos`` and sign-folded ``sin`` ``[T, 1, D]`` for :meth:`rotate`: built once per
        forward call and shared by every layer (and by Q and K)."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2] float32
        return torch.cat((cos, cos), -1).to(dtype)[:, None, :], torch.cat((-sin, sin), -1).to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` rotated: ``[x1·c − x2·s, x2·c + x1·s]`` (bitwise the same as spelling the
        halves out: ``x2·(−s) = −(x2·s)`` exactly), in four kernels."""
        t, n, d = x.shape
        swapped = x.reshape(t, n, 2, d // 2).flip(2).view(t, n, d)  # [x2, x1], a new tensor
        return (x * cos).add_(swapped.mul_(sin))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` by the angles of ``positions`` ``[T]``."""
        return self.rotate(x, *self.tables(positions, x.dtype))


#: weights smaller than this (elements; 512 KiB in float32, about a core's L2) keep row-major: cache-resident
#: GEMVs gain nothing from column-major, and small test models keep their exact historical numerics
COLUMN_MAJOR_MIN_NUMEL = 1 << 17


def _prepack(p: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a big ``[out, in]`` float32 weight (None for small ones: plain F.linear)."""
    if p.numel() < COLUMN_MAJOR_MIN_NUMEL or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(p.detach().contiguous(), 8)  # blocked for ~8-row inputs


def _version(p: torch.Tensor) -> int:
    """In-place update counter (inference-mode tensors have none: their packed copy is keyed on storage only)."""
    try:
        return p._version
    except RuntimeError:
        return -1


def _linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, parts: int = 1) -> torch.Tensor:
    """``F.linear(x, weight)``, via oneDNN when ``weight`` has a prepacked copy, or, for one row and a big
    column-major weight, as ``parts`` partial GEMVs over slices of the input dimension in one ``bmm``
    (ATen runs the batch in parallel: one thread per slice; MKL's single GEMV leaves half the memory
    bandwidth of a 2-core machine unused), summed."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    if parts > 1 and weight.stride(0) == 1 and weight.numel() >= COLUMN_MAJOR_MIN_NUMEL:
        n, k = weight.shape
        if k % parts == 0:
            partial = torch.bmm(x.reshape(parts, 1, k // parts), weight.t().view(parts, k // parts, n))  # [P, 1, N]
            return partial.sum(0)
    return F.linear(x, weight)


def _set_layout(p: nn.Parameter, column_major: bool) -> None:
    column_major = column_major and p.numel() >= COLUMN_MAJOR_MIN_NUMEL
    is_column_major = p.dim() == 2 and p.stride() == (1, p.shape[0])
    if column_major and not is_column_major:
        p.data = p.data.t().contiguous().t()
    elif not column_major and not p.is_contiguous():
        p.data = p.data.contiguous()


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
        self._packed_cache: tuple[tuple, dict[str, list]] | None = None
        self._set_weight_layout()

    def _apply(self, fn, recurse=True):  # .to() / .float() / .cuda() ... : re-pick the weight layout
        super()._apply(fn, recurse)
        self._set_weight_layout()
        return self

    def _set_weight_layout(self) -> None:
        """Store each matmul weight (logical shape ``[out, in]`` always) in the memory order the
        device/dtype reads fastest: on CPU in float32, column-major (``W.t()`` contiguous), so
        ``F.linear`` runs MKL's ``x @ Wt`` kernel, measurably faster for the memory-bound 1..8-row decode
        GEMMs (see benchmarks/README.md); row-major everywhere else (bfloat16 GEMMs on CPU are much
        slower column-major) and for small weights."""
        column_major = self.device.type == "cpu" and self.dtype == torch.float32
        self._packed_cache = None
        with torch.no_grad():
            for plist in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
                for p in plist:
                    _set_layout(p, column_major)
            _set_layout(self.lm_head, column_major)  # tied embeddings: the embedding table too

    #: Multi-row GEMMs (prefill, batched decode) of the big float32 weights on CPU run on oneDNN-prepacked
    #: copies of those weights, built on the first multi-row forward (~0.7 s for SmolLM2-135M) and rebuilt
    #: when a weight changes: on a 2-core AVX2 machine 1.5-2.3x faster than MKL at 2-16 rows (MKL repacks
    #: the whole weight on every small-M call) and 10-25% faster at prefill sizes, for one extra copy of
    #: those weights in memory (benchmarks/matmul_kernels.py). Single-row decode keeps the column-major
    #: parameters. Set False (on an instance or the class) to keep a single copy of the weights.
    packed_weights: bool = True

    def _packed(self, num_rows: int) -> dict[str, list] | None:
        """The prepacked weights for a ``num_rows``-row forward, or None (use ``F.linear``)."""
        if num_rows < 2 or not self.packed_weights or self.dtype != torch.float32 or self.device.type != "cpu":
            return None
        lists = {"qkv": self.qkv_proj, "o": self.o_proj, "gate_up": self.gate_up_proj, "down": self.down_proj}
        lists["lm_head"] = [self.lm_head]
        key = tuple((p.data_ptr(), _version(p)) for plist in lists.values() for p in plist)
        if self._packed_cache is None or self._packed_cache[0] != key:
            self._packed_cache = None
            try:
                with torch.no_grad():
                    packed = {name: [_prepack(p) for p in plist] for name, plist in lists.items()}
            except (RuntimeError, AttributeError):  # no oneDNN in this torch build: plain F.linear from now on
                self.packed_weights = False
                return None
            self._packed_cache = (key, packed)
        return self._packed_cache[1]

    def _gemv_parts(self, num_rows: int) -> int:
        """Slices a single-row float32 CPU GEMM is split into (one per intra-op thread), else 1."""
        if num_rows != 1 or self.dtype != torch.float32 or self.device.type != "cpu":
            return 1
        return torch.get_num_threads()

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

    #: ``all_reduce(partial [T, d]) -> [T, d]``, applied to the o_proj and down_proj outputs: under tensor
    #: parallelism (kvcore/distributed/sharding.py) it sums each rank's partial output; identity otherwise
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda partial: partial)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every attention layer: ``1 / sqrt(head_dim)`` for Llama."""
        return self.config.head_dim**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Run the decoder over packed tokens.

        :param input_ids: ``[T]`` int64 token ids.
        :param positions: ``[T]`` int64 absolute position of each token (RoPE).
        :param attention: stores each layer's K/V and attends (see :data:`Attention`).
        :returns: ``[T, d]`` final hidden states (after the last RMSNorm).
        """
        c = self.config
        num_tokens = input_ids.shape[0]
        eps = c.rms_norm_eps
        num_heads, head_dim = c.num_attention_heads, c.head_dim
        qk_size, rope_heads = self.q_size + self.kv_size, c.num_attention_heads + c.num_key_value_heads
        cos, sin = self.rotary.tables(positions, self.dtype)  # once per call, shared by all layers
        packed = self._packed(num_tokens)
        parts = self._gemv_parts(num_tokens)
        no_pack = [None] * c.num_hidden_layers
        qkv_w, o_w, gate_up_w, down_w = (packed[n] if packed else no_pack for n in ("qkv", "o", "gate_up", "down"))
        h = F.embedding(input_ids, self.embed_tokens)  # (T, d)
        for i in range(c.num_hidden_layers):
            x = rms_norm(h, self.input_norm[i], eps)
            qkv = _linear(x, self.qkv_proj[i], qkv_w[i], parts)  # (T, (H + 2 H_kv) D)
            # Q and K are adjacent in the fused projection: one RoPE over H + H_kv heads.
            qk = self.rotary.rotate(qkv[:, :qk_size].view(num_tokens, rope_heads, head_dim), cos, sin)
            q, k = qk[:, :num_heads], qk[:, num_heads:]  # (T, H, D), (T, H_kv, D) views
            v = qkv[:, qk_size:].view(num_tokens, c.num_key_value_heads, head_dim)  # (T, H_kv, D)
            attn = attention(i, q, k, v)  # (T, H, D)
            # h is this forward's own tensor: residual adds and the SwiGLU product run in place, which saves
            # the prefill a fresh multi-megabyte allocation (page faults) per op; the values are the same.
            h.add_(self.all_reduce(_linear(attn.reshape(num_tokens, self.q_size), self.o_proj[i], o_w[i], parts)))
            x = rms_norm(h, self.post_norm[i], eps)
            gate, up = _linear(x, self.gate_up_proj[i], gate_up_w[i], parts).chunk(2, dim=-1)  # (T, I) each
            h.add_(self.all_reduce(_linear(F.silu(gate).mul_(up), self.down_proj[i], down_w[i], parts)))
        return rms_norm(h, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d]`` hidden states → ``[N, V]`` float32 logits."""
        rows = hidden.shape[0]
        packed = self._packed(rows)
        return _linear(hidden, self.lm_head, packed["lm_head"][0] if packed else None, self._gemv_parts(rows)).float()
