"""The attention-backend interface and the per-call metadata every backend receives.

Tokens of all sequences in one forward call are *packed* along a single axis (vLLM / flash-attn
"varlen" layout): for B sequences with ``query_lens = [q_0, ..., q_{B-1}]`` the model's tensors have
``T = sum(query_lens)`` rows. One call therefore serves

* prefill: ``context_len = 0``, ``query_len = prompt length``, causal mask;
* decode: ``query_len = 1``, attends to the whole cache with no mask;
* a prefill that continues an existing cache: ``context_len > 0``, ``query_len > 1``; the causal mask is
  aligned bottom-right, i.e. query row ``i`` sits at absolute position ``context_len + i``.

How each decoder layer attends is its :class:`LayerAttention` (the scale, and the variants beyond plain
causal attention: a sliding window, logit soft-capping, attention sinks). The model declares one per layer,
the metadata carries them (:meth:`AttentionMetadata.layer`), and a backend declares the variants it serves
per phase in :class:`BackendCapabilities` (see docs/attention-variants.md).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from kvcore.kv_cache import KVCache

__all__ = [
    "AttentionMetadata", "BackendCapabilities", "AttentionBackend", "LayerAttention", "VARIANTS", "causal_mask",
    "cu_seqlens", "explicit_attention", "variants_of",
]

#: a backend's own per-call plan type (``AttentionMetadata`` itself when it needs nothing more)
PlanT = TypeVar("PlanT")


#: the attention variants beyond plain causal attention, by the name capabilities use -> what a reason says is
#: missing ("no soft-capping")
VARIANTS = {"sliding_window": "sliding windows", "softcap": "soft-capping", "sinks": "attention sinks"}


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """How one decoder layer attends (every layer is causal). For query ``i`` at absolute position ``p_i``
    and key ``j`` at position ``p_j``:

    1. ``s_ij = scale · q_i · k_j`` (``scale``: ``1 / √head_dim``, or Gemma's ``query_pre_attn_scalar ** -0.5``);
    2. with ``softcap = c``: ``s_ij = c · tanh(s_ij / c)``, before any mask (Gemma 2);
    3. key ``j`` is visible when ``p_j <= p_i`` and, with ``sliding_window = W``, ``p_i - p_j < W``: the query
       and the ``W - 1`` keys before it (Hugging Face's ``sliding_window``; flash-attn's ``window_size =
       (W - 1, 0)``); invisible scores are ``-∞``;
    4. ``P = softmax`` over the visible keys and, with ``sinks`` (``[H]`` float32, one learned logit per query
       head, GPT-OSS), that head's sink logit as one more entry that weights no value;
    5. ``o_i = Σ_j P_ij v_j``.
    """

    scale: float
    sliding_window: int | None = None  # tokens a query sees, itself included (None: the whole sequence)
    softcap: float | None = None  # c of c · tanh(s / c) on the scaled scores
    sinks: torch.Tensor | None = None  # [H] float32, one logit per query head

    def __post_init__(self) -> None:
        window, cap = self.sliding_window, self.softcap
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
        if cap is not None and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a finite number > 0 or None, got {cap!r}")
        if self.sinks is not None and (self.sinks.dim() != 1 or not self.sinks.is_floating_point()):
            raise ValueError(f"sinks must be a 1-D float tensor [num_heads], got {tuple(self.sinks.shape)}")

    @property
    def variants(self) -> frozenset[str]:
        """The :data:`VARIANTS` this layer uses (empty: plain causal attention)."""
        used = {"sliding_window": self.sliding_window is not None, "softcap": self.softcap is not None,
                "sinks": self.sinks is not None}
        return frozenset(name for name, on in used.items() if on)

    def describe(self) -> str:
        parts = [f"scale {self.scale:.4g}"]
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)


def variants_of(layers: Sequence[LayerAttention]) -> frozenset[str]:
    """Every variant any of ``layers`` uses."""
    return frozenset().union(*(layer.variants for layer in layers))


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one forward call over a packed batch of ``B`` sequences; built once per step by the core.

    Python lists mirror the small integer tensors so backends can shape work without a device sync.
    Cache addressing is the core's block tables: token ``p`` of sequence ``i`` lives in block
    ``block_tables[i][p // block_size]`` at offset ``p % block_size``; ``slot_mapping`` is that
    address flattened (``block * block_size + offset``) for each packed token. A per-sequence (slot)
    layout has one block per sequence, so ``block_tables[i][0]`` is the sequence's slot.
    """

    query_lens: list[int]  # new tokens per sequence, length B
    context_lens: list[int]  # tokens already cached before this call, length B
    block_tables: list[list[int]]  # [B] physical block ids per sequence, in token order
    block_size: int  # tokens per block of the cache this call writes
    positions: torch.Tensor  # [T] int64, absolute position of every packed query token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of query_lens (row offsets into T)
    seq_lens_t: torch.Tensor  # [B] int32, context_len + query_len per sequence
    block_tables_t: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (masked by seq_lens)
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of every packed token
    scale: float  # softmax scale of a layer without its own spec, from the model (1 / sqrt(head_dim) for Llama)
    #: each decoder layer's attention, from the model; empty: every layer plain causal at ``scale``
    layers: tuple[LayerAttention, ...] = ()

    def layer(self, layer_idx: int) -> LayerAttention:
        """How layer ``layer_idx`` attends: what a backend's ``forward`` must implement."""
        return self.layers[layer_idx] if self.layers else LayerAttention(self.scale)

    @property
    def variants(self) -> frozenset[str]:
        """The variants this call's layers use (what the backend must declare for the call's phase)."""
        return variants_of(self.layers)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        """Tokens in the cache per sequence once this call has written its K/V."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one query row (a decode step)."""
        return self.max_query_len == 1 and min(self.context_lens) > 0

    @property
    def slots(self) -> list[int]:
        """First block of each sequence: its slot in a per-sequence layout."""
        return [table[0] for table in self.block_tables]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        scale: float,
        device: torch.device,
        layers: Sequence[LayerAttention] = (),
    ) -> AttentionMetadata:
        """The metadata of one call: ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones;
        ``layers``: each decoder layer's attention (empty: plain causal at ``scale``)."""
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])  # [T]
        seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # [T]
        blocks = tables.long()[seq_of_token, positions // block_size]
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            positions=positions.to(device),
            cu_seqlens_q=cu_seqlens(query_lens, device),
            seq_lens_t=seq_lens.to(device),
            block_tables_t=tables.to(device),
            slot_mapping=(blocks * block_size + positions % block_size).to(device),
            scale=scale,
            layers=tuple(layers),
        )


def cu_seqlens(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` ``[B + 1]``: row offsets of packed sequences (flash-attn's
    ``cu_seqlens``)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def causal_mask(
    context_len: int, query_len: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """``[query_len, context_len + query_len]`` bool, True where attention is allowed: the causal mask
    aligned bottom-right, query ``i`` sitting at absolute position ``context_len + i`` and seeing keys
    ``0 .. context_len + i``. With ``context_len == 0`` it is the ordinary lower-triangular mask. With a
    sliding ``window``, only the last ``window`` of those keys (the query's own included)."""
    query_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    key_pos = torch.arange(context_len + query_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: LayerAttention
) -> torch.Tensor:
    """Attention with every :class:`LayerAttention` variant, spelled out in float32 for backends whose fused
    kernel lacks one (soft-capping and sinks have no ``scaled_dot_product_attention`` argument).

    :param q: ``[B, H, n, D]``; ``k``, ``v``: ``[B, H_kv, S, D]`` (``H % H_kv == 0``).
    :param mask: broadcastable to ``[B, H, n, S]``: bool (True = visible) or additive float; None: all visible.
    :returns: ``[B, H, n, D]`` in ``q``'s dtype.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # (B, H, S, D)
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-2, -1) * layer.scale  # (B, H, n, S)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.float()
    if layer.sinks is None:
        return (scores.softmax(dim=-1) @ v).to(q.dtype)
    sink = layer.sinks.float().to(q.device).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, n, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink weights no value
    return (probs @ v).to(q.dtype)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. ``kvcore backends`` renders its table from these declarations."""

    devices: frozenset[str]  # torch device types, e.g. {"cpu", "cuda"}
    dtypes: frozenset[torch.dtype]
    kv_layouts: tuple[str, ...]  # KV-cache layouts it reads, preferred first ("contiguous", "paged")
    head_dims: frozenset[int] | None = None  # None: any head size
    max_head_dim: int | None = None
    head_dim_multiple: int | None = None  # e.g. 8: kernels that vectorise over head_dim
    supports_gqa: bool = True  # H_kv < H (grouped-query / multi-query attention)
    supports_prefill: bool = True
    supports_decode: bool = True
    min_compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (8, 0) for sm80
    #: its decode ``forward`` can be traced by ``torch.compile`` (``EngineConfig.compile``): tensor ops only,
    #: no host syncs, reads only the plan's tensors and ints, writes the cache only through whole cache
    #: tensors, never views of them (see kvcore/compile.py)
    compilable: bool = False
    #: the :data:`VARIANTS` (``"sliding_window"``, ``"softcap"``, ``"sinks"``) its prefill / its decode
    #: implements; a layer using another is refused with :meth:`reasons_variants`, never run wrong
    prefill_variants: frozenset[str] = frozenset()
    decode_variants: frozenset[str] = frozenset()

    def variants(self, phase: str) -> frozenset[str]:
        """The variants of ``phase`` ("prefill" or "decode")."""
        return self.prefill_variants if phase == "prefill" else self.decode_variants

    def reasons_variants(self, needed: Collection[str], phases: Sequence[str] = ("prefill", "decode")) -> list[str]:
        """Human reasons ("decode: no soft-capping") why the ``needed`` variants are not all served in
        ``phases`` ([] = fine)."""
        reasons = []
        for phase in phases:
            missing = sorted(set(needed) - self.variants(phase))
            if missing:
                reasons.append(f"{phase}: no {', no '.join(VARIANTS.get(m, m) for m in missing)}")
        return reasons

    def reasons_unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        """Human reasons why this configuration is outside the declared capabilities ([] = fine)."""
        reasons = []
        if device.type not in self.devices:
            reasons.append(f"device '{device.type}' not supported (supports: {', '.join(sorted(self.devices))})")
        if dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')} not supported (supports: {names})")
        if self.head_dims is not None and head_dim not in self.head_dims:
            reasons.append(f"head_dim {head_dim} not supported (supports: {sorted(self.head_dims)})")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            reasons.append(f"head_dim {head_dim} exceeds the maximum {self.max_head_dim}")
        if self.head_dim_multiple and head_dim % self.head_dim_multiple:
            reasons.append(f"head_dim {head_dim} is not a multiple of {self.head_dim_multiple}")
        if num_heads % num_kv_heads:
            reasons.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        elif num_kv_heads != num_heads and not self.supports_gqa:
            reasons.append(f"grouped-query attention ({num_heads} query / {num_kv_heads} KV heads) not supported")
        if device.type == "cuda" and self.min_compute_capability and torch.cuda.is_available():
            have = torch.cuda.get_device_capability(device)
            if have < self.min_compute_capability:
                need = ".".join(map(str, self.min_compute_capability))
                reasons.append(f"GPU compute capability {have[0]}.{have[1]} < {need}")
        return reasons


class AttentionBackend(abc.ABC, Generic[PlanT]):
    """An attention implementation. Subclass it, declare ``name`` and ``capabilities``, implement
    :meth:`forward` (and :meth:`plan` when per-call work can be shared by the layers), and register the
    class through the ``kvcore_register_backends`` hook.

    A backend instance is stateless across calls; all per-sequence state lives in the
    :class:`~kvcore.kv_cache.KVCache` it is handed, all per-call state in the plan.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    description: ClassVar[str] = ""
    #: higher wins when kvcore picks a backend automatically among the available ones
    priority: ClassVar[int] = 0

    def __init__(self, **options: Any) -> None:
        """``options`` come from the ``[backends.<name>]`` table of the config file."""
        if options:
            from kvcore.errors import ConfigError

            raise ConfigError(f"backend '{self.name}' got unknown options: {', '.join(sorted(options))}")

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when the backend can run on this machine, else a one-line human reason
        (package missing, no CUDA device, compute capability too old...). Must not raise."""
        return None

    def validate(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
    ) -> list[str]:
        """All reasons this backend cannot serve that model configuration ([] = it can)."""
        reason = self.availability()
        reasons = [reason] if reason else []
        return reasons + self.capabilities.reasons_unsupported(
            device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads
        )

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> PlanT:
        """Turn the call's metadata into this backend's own typed plan, once per forward call (before the
        first layer); every layer's :meth:`forward` receives it. The default plan is ``meta`` itself; a
        backend with work its layers share (gather indices, masks) declares ``AttentionBackend[MyPlan]``
        and returns a dataclass holding ``meta`` and that work."""
        return meta  # type: ignore[return-value]

    @abc.abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        plan: PlanT,
    ) -> torch.Tensor:
        """Write this call's K/V into ``cache`` (``cache.write``), then attend as the layer's
        :class:`LayerAttention` (``meta.layer(layer_idx)``) says: a backend is only handed layers whose
        variants its capabilities declare for the call's phase.

        :param layer_idx: decoder layer, selects the cache layer and the layer's attention spec.
        :param q: ``[T, H, D]`` queries, RoPE already applied.
        :param k: ``[T, H_kv, D]`` new keys, RoPE already applied.
        :param v: ``[T, H_kv, D]`` new values.
        :param cache: the KV cache; its ``layout`` is one of ``capabilities.kv_layouts``.
        :param plan: what :meth:`plan` returned for this call.
        :returns: ``[T, H, D]`` attention output, same dtype as ``q``.
        """
