"""``flex``: attention through PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), compiled by
``torch.compile`` into one fused kernel per shape (inductor's C++ template on CPU, Triton on CUDA).

Every variant is code here, so a registered one needs no new kernel (``capabilities.variants_as_code``):

* causal attention, the sliding window, the sequence's real rows and every registered ``mask_mod`` are one
  ``mask_mod`` (:func:`~kvcore.backends.flex_mods.mask_mod`), turned into a block mask once per call for each
  distinct mask (layers with the same window and mask functions share it): in ``plan``, or, for a registered
  ``mask_mod`` that may depend on the head, by the first layer that uses it (a plan does not know the heads);
* soft-capping, then every registered ``score_mod`` in order, is one ``score_mod``;
* sinks come after the kernel: its log-sum-exp ``lse`` per row gives ``out · sigmoid(lse − sink)``, the output
  with the sink logit in the softmax's denominator (it weights no value). torch's compiled CPU kernel does not
  return ``lse`` (torch 2.13), so on CPU a layer with sinks runs FlexAttention eagerly (correct, not fast).

Layout of a call: ``B`` sequences, each ``q_len`` query rows (its real rows, then padding that sees no key)
against ``kv_len`` keys at their absolute positions. Both lengths are rounded up to a few sizes
(:func:`~kvcore.backends.flex_mods.bucket`) so a compiled kernel serves every decode step up to its key bucket;
padded keys lie in every real row's future and padded rows see nothing, so the block mask skips them. A new
batch size still compiles once. Keys are read per the layout's contract: a contiguous cache's slots as views
(``k[layer, slot, :, :kv_len]``, copied only when the batch's slots are not consecutive), a paged cache's
blocks through ``gather_blocks`` (the rows no query sees zeroed, as ``paged`` does: stale rows may hold NaN).

Option (``[backends.flex]``): ``compile`` (default true); false runs FlexAttention eagerly, which materialises
each call's scores (the fast test tier runs that way), so it pads only to the tile, and float16 on CPU runs in
float32. Compiled, inductor's caches live under kvcore's cache folder
(:func:`~kvcore.backends.flex_mods.use_kvcore_inductor_cache`), so a second process reuses the kernels.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.layer_attention import VARIANTS, LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata, host_to_device

from .contiguous import ALL_DTYPES
from .flex_mods import MIN_KEYS, block_mask, bucket, flex_reason, mask_key, score_mod, use_kvcore_inductor_cache
from .paged import PagedBackend

__all__ = ["FlexBackend", "FlexPlan"]

#: the fewest query rows a call with several rows per sequence is padded to
MIN_QUERY_ROWS = 16
#: compiled kernels dynamo keeps per function (and in all, ``accumulated_recompile_limit``) before it sends every
#: later shape to its eager fallback, which materialises the scores of the padded shapes and is not what a compiled
#: backend certifies: far above what one engine meets, since the conformance suite, whose cases sweep head layouts,
#: head sizes, dtypes and batch sizes in one process, meets hundreds (each compiles once, then loads from the cache)
RECOMPILE_LIMIT = 4096


@dataclass(frozen=True)
class FlexPlan:
    """What every layer of one forward call shares."""

    meta: AttentionMetadata
    q_len: int  # query rows per sequence, padded (1 in a decode step)
    kv_len: int  # keys per sequence, padded
    context_lens: torch.Tensor  # [B] int64
    query_lens: torch.Tensor  # [B] int64
    #: [T] int64 row ``b * q_len + i`` of each packed token among the padded rows; None when ``q_len`` is 1
    rows: torch.Tensor | None
    #: contiguous cache: ``[B]`` int64 slots, None when they are consecutive (the keys are then a view)
    slots: torch.Tensor | None = None
    #: paged cache: ``[B * kv_len / block_size]`` int64, every sequence's block table padded with block 0
    tables: torch.Tensor | None = None
    #: paged cache: sliding window (None: none) -> ``[n]`` rows ``b * kv_len + j`` no query of the layer sees, or None
    hidden_rows: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    #: :func:`mask_key` -> the block mask (:meth:`FlexBackend._block_mask`)
    masks: dict[tuple, Any] = field(default_factory=dict)


def _eager_flex(*args, **kwargs):
    """FlexAttention uncompiled, without its once-per-process advice to compile (the user chose eager)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


class FlexBackend(AttentionBackend[FlexPlan]):
    name = "flex"
    description = "PyTorch FlexAttention (torch.compile'd), any variant as score_mod/mask_mod; contiguous or paged"
    priority = 1  # below sdpa and paged: its first call per shape compiles
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=ALL_DTYPES,
        kv_layouts=("contiguous", "paged"),
        prefill_variants=frozenset(VARIANTS),
        decode_variants=frozenset(VARIANTS),
        variants_as_code=True,
        multi_token_decode=True,  # rows of several tokens after a cache are a call like any other
    )

    def __init__(self, compile: bool = True, **options: Any) -> None:
        super().__init__(**options)
        if not isinstance(compile, bool):
            raise ConfigError(f"backend 'flex': compile must be true or false, got {compile!r}")
        #: what attends: flex_attention compiled, or eager
        self.kernel = _eager_flex
        #: whether calls are padded to the few sizes a compiled kernel is specialised on (:func:`bucket`)
        self.compiled = compile
        if compile:
            from torch.nn.attention.flex_attention import flex_attention

            use_kvcore_inductor_cache()
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
            self.kernel = torch.compile(flex_attention, dynamic=False)

    @classmethod
    def availability(cls) -> str | None:
        return flex_reason()

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> FlexPlan:
        device = meta.positions.device
        q_len = 1 if meta.max_query_len == 1 else bucket(meta.max_query_len, MIN_QUERY_ROWS, compiled=self.compiled)
        rows = None
        if q_len > 1:
            rows = torch.tensor([b * q_len + i for b, n in enumerate(meta.query_lens) for i in range(n)])
        lens = torch.tensor([meta.context_lens, meta.query_lens])
        lens, *rows_t = host_to_device([lens] + ([rows] if rows is not None else []), device)
        common = dict(meta=meta, q_len=q_len, context_lens=lens[0], query_lens=lens[1],
                      rows=rows_t[0] if rows_t else None)
        if cache.layout == "contiguous":
            kv_len = bucket(meta.max_seq_len, MIN_KEYS, most=cache.block_size, compiled=self.compiled)
            slots = meta.slots
            consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
            slots_t = None if consecutive else host_to_device([torch.tensor(slots)], device)[0]
            plan = FlexPlan(**common, kv_len=kv_len, slots=slots_t)
        else:
            bs = cache.block_size
            num_blocks = -(-bucket(meta.max_seq_len, MIN_KEYS, compiled=self.compiled) // bs)
            kv_len = num_blocks * bs
            tables = torch.tensor([(t + [0] * num_blocks)[:num_blocks] for t in meta.block_tables]).flatten()
            # a decode row sees only its window's keys; rows of a longer call see different windows, so only the
            # keys past each sequence's length are hidden from all of them
            windows = {layer.sliding_window for layer in meta.layers} - {None} if meta.max_query_len == 1 else set()
            hidden = {w: PagedBackend._hidden_rows(meta.seq_lens, kv_len, w, device) for w in windows | {None}}
            plan = FlexPlan(**common, kv_len=kv_len, tables=host_to_device([tables], device)[0], hidden_rows=hidden)
        for layer in meta.layers or (meta.layer(0),):
            if len(mask_key(layer)) == 1:  # no registered mask_mod: the same for every head, made here
                self._block_mask(plan, layer, None)
        return plan

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cache: KVCache,
        plan: FlexPlan,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import AuxRequest

        meta, num_heads, d = plan.meta, q.shape[1], q.shape[2]
        cache.write(layer_idx, k, v, meta)
        layer = meta.layer(layer_idx)
        keys, values = self._keys(layer_idx, cache, plan, layer, q.dtype)  # [B, H_kv, kv_len, D]
        if plan.rows is None:
            qs = q.view(meta.num_seqs, 1, num_heads, d)
        else:
            qs = q.new_zeros(meta.num_seqs * plan.q_len, num_heads, d).index_copy_(0, plan.rows, q)
            qs = qs.view(meta.num_seqs, plan.q_len, num_heads, d)
        qs = qs.transpose(1, 2)  # [B, H, q_len, D]
        args = dict(score_mod=score_mod(layer, plan.context_lens), block_mask=self._block_mask(plan, layer, num_heads),
                    scale=layer.scale, enable_gqa=keys.shape[1] != num_heads)
        kernel = self.kernel if layer.sinks is None or q.device.type == "cuda" else _eager_flex  # see the docstring
        if kernel is _eager_flex and q.dtype == torch.float16 and q.device.type == "cpu":
            # the CPU has no fast float16 GEMM; eager FlexAttention accumulates in float32 anyway
            qs, keys, values = qs.float(), keys.float(), values.float()
        if layer.sinks is None:
            out = kernel(qs, keys, values, **args).to(q.dtype)
        else:
            out, aux = kernel(qs, keys, values, **args, return_aux=AuxRequest(lse=True))
            sinks = layer.sinks.to(device=q.device, dtype=torch.float32).view(1, -1, 1)  # [1, H, 1]
            out = (out.float() * torch.sigmoid(aux.lse - sinks)[..., None]).to(q.dtype)
        out = out.transpose(1, 2).reshape(-1, num_heads, d)  # [B * q_len, H, D]
        return out if plan.rows is None else out.index_select(0, plan.rows)

    @staticmethod
    def _keys(layer_idx: int, cache: KVCache, plan: FlexPlan, layer: LayerAttention, dtype: torch.dtype):
        """The layer's keys and values of every sequence, ``[B, H_kv, kv_len, D]`` each, in ``dtype``."""
        if plan.tables is None:
            ks, vs = cache.k[layer_idx, :, :, : plan.kv_len], cache.v[layer_idx, :, :, : plan.kv_len]
            if plan.slots is None:
                first = plan.meta.slots[0]
                return ks[first : first + plan.meta.num_seqs], vs[first : first + plan.meta.num_seqs]
            return ks.index_select(0, plan.slots), vs.index_select(0, plan.slots)
        k, v = cache.gather_blocks(layer_idx, plan.tables)  # [B * blocks, block_size, H_kv, D], copies
        h_kv, d = k.shape[2], k.shape[3]
        hidden = plan.hidden_rows.get(layer.sliding_window, plan.hidden_rows[None])
        if hidden is not None:
            k.view(-1, h_kv, d).index_fill_(0, hidden, 0)
            v.view(-1, h_kv, d).index_fill_(0, hidden, 0)
        shape = (plan.meta.num_seqs, plan.kv_len, h_kv, d)
        return k.view(shape).transpose(1, 2).to(dtype), v.view(shape).transpose(1, 2).to(dtype)

    @staticmethod
    def _block_mask(plan: FlexPlan, layer: LayerAttention, num_heads: int | None):
        """The block mask of ``layer``'s :func:`mask_key`, made once per call: in :meth:`plan`, or by the first layer
        that needs it when a registered ``mask_mod`` may depend on the head (a plan does not know the head count)."""
        key = mask_key(layer)
        if key not in plan.masks:
            plan.masks[key] = block_mask(layer, plan.context_lens, plan.query_lens, plan.q_len, plan.kv_len,
                                         num_heads if len(key) > 1 else None)
        return plan.masks[key]


@hookimpl
def kvcore_register_backends(register):
    register(FlexBackend)
