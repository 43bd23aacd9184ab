"""``cpu_decode``: kvcore's own C++ attention kernels on CPU: every decode step, and bfloat16 prefills.

A decode step's attention is one query row per head against the whole cache, a shape fused prefill kernels
are not built for: torch's CPU flash-attention kernel runs it through its blocked GEMM machinery, whose
per-call and per-block overhead dominates at short contexts, and with three KV heads it gives two threads
three work items. ``torch.ops.kvcore.decode_attention`` (:mod:`kvcore.kernels.cpu_kernels`, built on first use)
reads each key and value row once for the ``H / H_kv`` query heads sharing it, splits long contexts into
chunks so every thread has work even at batch 1 ("split-K", merged with the online-softmax rescaling) and
computes in float32 (bfloat16 rows on AVX512_BF16 CPUs: products of bfloat16 pairs summed in float32 by
``vdpbf16ps``, probabilities rounded to bfloat16 as in prefill). At long contexts with many sequences both
kernels wait on memory.

In bfloat16 on CPUs with AVX512_BF16, prefill attention is kvcore's too: ``torch.ops.kvcore.prefill_attention``
multiplies bfloat16 pairs into float32 sums with ``vdpbf16ps``, flash-attention style (tiles of 4 query rows
against blocks of 32 keys, online softmax, probabilities rounded to bfloat16 before they weight the values, as
GPU flash attention does), after repacking each KV head's keys and values so one vector load feeds 16 lanes.
torch's CPU flash-attention kernel runs bfloat16 no faster than float32. float32 prefill stays torch's, the exact path.

A few query rows continuing a cache (a speculative verification's ``[last token, drafts]``, a short prefill
chunk) take the same per-layer call as a decode step, ``cached_decode_attention`` with ``R`` tokens per sequence:
it writes their K/V rows and attends every row to its own causal length while reading each block of the context
once for all of them (the prefill kernel would repack the whole context for its tiles).

Everything else is the ``sdpa`` backend's: the same contiguous cache and cache rows; a decode batch whose
sequences are not on consecutive slots goes through the prefill path. A decode batch on consecutive slots runs
each layer as one call, ``torch.ops.kvcore.cached_decode_attention``: the cache write of sdpa's two ``index_copy_``
calls and the decode kernel over the same views, without the Python and dispatch of the ops between them
(each layer's arguments planned once per step). A compiled decode step traces sdpa's path instead.

When every layer of a bfloat16 or float32 call takes that call (no layer with sinks, no sequence on the prefill path),
:meth:`CPUDecodeBackend.decode_stack` describes the call's cache rows, lengths and slots as a
:class:`~kvcore.interfaces.decode_stack.DecodeStack`: a model with fused int4a8 layers then runs layers 1.. as one
native operator that writes the cache and attends exactly as these per-layer calls do
(:mod:`kvcore.model.fused_layer`).

Attention variants: the decode kernel takes a layer's sliding window (it reads only the last ``window`` keys of
each row) and soft-cap (applied to each block's scores before its online-softmax step); decode layers with
sinks, and prefill layers with any variant, run sdpa's masked and explicit paths (correct, not the kernels'
speed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.attention import BackendCapabilities
from kvcore.interfaces.decode_stack import DecodeStack
from kvcore.interfaces.layer_attention import VARIANTS, LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.kernels.cpu_kernels import kernel_reasons, load_kernels

from .contiguous import ContiguousKVCache
from .sdpa import SDPABackend, SDPAPlan

#: the kernel's limits (csrc/decode_attention.cpp)
MAX_HEAD_DIM = 256
MAX_GROUP = 16
#: rows continuing a cache up to this many take the decode kernel (the kernel's limit of tokens per sequence)
SHORT_ROWS = 16


@dataclass(frozen=True)
class ShortRows:
    """One sequence's query rows continuing its cache, as one ``cached_decode_attention`` call per layer."""

    rows: torch.Tensor  # [L, q_len * H_kv] its tokens' cache rows (a view of the plan's)
    seq_len: torch.Tensor  # [1] int32: context_len + q_len
    slot: int


@dataclass(frozen=True)
class CPUDecodePlan(SDPAPlan):
    #: each layer's ``(scale, window, softcap)`` for ``cached_decode_attention``, None for a layer with sinks; the
    #: whole tuple None where no sequence takes the call (sdpa's path)
    layer_args: tuple[tuple[float, int, float] | None, ...] | None = None
    #: the same values by kind, ``(scales, windows, softcaps)``, for :meth:`CPUDecodeBackend.decode_stack`; None
    #: when a layer has sinks or no sequence takes the call
    stack_args: tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]] | None = None
    #: a call that is not a decode batch on consecutive slots: each sequence's ShortRows, None for one that takes
    #: the prefill path
    sequences: tuple[ShortRows | None, ...] | None = None


class CPUDecodeBackend(SDPABackend):
    name = "cpu_decode"
    description = "kvcore's C++ attention kernels: split-K decode, bfloat16 prefill (CPU; built on first use)"
    priority = 5  # never picked over sdpa unasked: its first use runs the C++ compiler
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        kv_layouts=("contiguous",),
        max_head_dim=MAX_HEAD_DIM,
        compilable=True,
        # the decode kernel takes windows and soft-caps; the rest runs sdpa's paths (see the module docstring)
        prefill_variants=frozenset(VARIANTS),
        decode_variants=frozenset(VARIANTS),
        multi_token_decode=True,  # a few rows after a cache take the decode kernel (ShortRows)
        decode_stack=True,  # the calls that take the decode kernel in every layer (see decode_stack)
    )

    #: each layer of a decode batch on consecutive slots as one cached_decode_attention call; False: sdpa's ops
    #: around the same kernel (what tests and benchmarks compare it with)
    cached_decode: bool = True
    #: offer such calls to the fused layers' native decode stack (:meth:`decode_stack`); False: every layer through
    #: :meth:`forward` (what tests and benchmarks compare it with)
    native_stack: bool = True

    def __init__(self, **options) -> None:
        super().__init__(**options)
        load_kernels()
        self._bf16_prefill = torch.ops.kvcore.built_with("avx512_bf16")  # built for AVX512_BF16

    @classmethod
    def availability(cls) -> str | None:
        reasons = kernel_reasons()
        return "; ".join(reasons) if reasons else None

    def validate(self, *, device, dtype, head_dim, num_heads, num_kv_heads) -> list[str]:
        reasons = super().validate(device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads)
        if num_kv_heads and num_heads // num_kv_heads > MAX_GROUP:
            group = num_heads // num_kv_heads
            reasons.append(f"{group} query heads per KV head (the kernel takes at most {MAX_GROUP})")
        return reasons

    def plan(self, meta: AttentionMetadata, cache: ContiguousKVCache) -> CPUDecodePlan:
        plan = super().plan(meta, cache)
        sequences = None
        if plan.decode_slot is None:
            heads, starts = cache.spec.num_kv_heads, meta.query_starts
            sequences = tuple(
                ShortRows(plan.rows[:, starts[i] * heads : starts[i + 1] * heads], meta.seq_lens_t[i : i + 1], slot)
                if ctx > 0 and q_len <= SHORT_ROWS else None
                for i, (slot, ctx, q_len) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)))
        if not self.cached_decode or (sequences is not None and not any(sequences)):
            return CPUDecodePlan(**vars(plan))
        layer_args, stack_args = self._layer_args(meta, plan.rows.shape[0])
        return CPUDecodePlan(**vars(plan), layer_args=layer_args, stack_args=stack_args, sequences=sequences)

    def _layer_args(self, meta: AttentionMetadata, num_layers: int) -> tuple[tuple, tuple | None]:
        """The plan's ``layer_args`` and ``stack_args``, made together once per model (every step's metadata
        carries the same layers) and again when the layers, the scale or the layer count change."""
        key = (meta.layers, meta.scale, num_layers)
        cached = getattr(self, "_args", None)
        if cached is None or cached[0][0] is not meta.layers or cached[0][1:] != key[1:]:
            per_layer = tuple(None if layer.sinks is not None else
                              (layer.scale, layer.sliding_window or 0, layer.softcap or 0.0)
                              for layer in map(meta.layer, range(num_layers)))
            cached = self._args = (key, (per_layer, None if None in per_layer else tuple(zip(*per_layer))))
        return cached[1]

    def decode_stack(self, plan: CPUDecodePlan, cache: ContiguousKVCache) -> DecodeStack | None:
        """The call's attention for ``torch.ops.kvcore.decode_stack`` when :meth:`forward` would run every layer as
        ``cached_decode_attention`` calls on a bfloat16 or float32 cache (no layer with sinks, no sequence taking the
        prefill path, not traced): the decode batch as one call group, or each sequence's short rows as its own."""
        if (not self.native_stack or plan.stack_args is None or cache.k.dtype not in (torch.bfloat16, torch.float32)
                or torch.compiler.is_compiling()):
            return None
        if plan.sequences is None:
            groups = [(plan.rows, plan.meta.seq_lens_t, plan.decode_slot, plan.decode_len)]
        elif all(plan.sequences):
            meta = plan.meta
            groups = [(seq.rows, seq.seq_len, seq.slot, meta.context_lens[i] + meta.query_lens[i])
                      for i, seq in enumerate(plan.sequences)]
        else:
            return None
        rows, lens, slots, max_lens = zip(*groups)
        return DecodeStack(cache.k, cache.v, rows, lens, slots, max_lens, *plan.stack_args)

    def decode_stack_reason(self) -> str | None:
        if not self.native_stack:
            return f"backend '{self.name}' has its native stack switched off (native_stack)"
        return super().decode_stack_reason()

    def forward(self, layer_idx: int, q, k, v, cache: ContiguousKVCache, plan: CPUDecodePlan) -> torch.Tensor:
        # compiled steps trace sdpa's path: functionalizing an in-place custom op on the cache would copy the cache
        args = None if torch.compiler.is_compiling() or plan.layer_args is None else plan.layer_args[layer_idx]
        if args is None:
            return super().forward(layer_idx, q, k, v, cache, plan)
        op = torch.ops.kvcore.cached_decode_attention
        if plan.sequences is None:  # a decode batch on consecutive slots
            return op(q, k, v, cache.k, cache.v, plan.rows, plan.meta.seq_lens_t, layer_idx, plan.decode_slot,
                      plan.decode_len, *args)
        meta, starts, outs = plan.meta, plan.meta.query_starts, []
        for i, seq in enumerate(plan.sequences):
            s, e = starts[i], starts[i + 1]
            if seq is None:
                outs.append(self._prefill_sequence(layer_idx, i, q[s:e], k[s:e], v[s:e], cache, plan))
            else:
                ctx_len = meta.context_lens[i] + e - s
                outs.append(op(q[s:e], k[s:e], v[s:e], cache.k, cache.v, seq.rows, seq.seq_len, layer_idx, seq.slot,
                               ctx_len, *args))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _prefill_sequence(self, layer_idx: int, i: int, q, k, v, cache: ContiguousKVCache,
                          plan: CPUDecodePlan) -> torch.Tensor:
        """Sequence ``i`` of a call that mixes it with short rows: its cache write and prefill attention alone."""
        meta, heads, d = plan.meta, k.shape[1], k.shape[-1]
        rows = plan.rows[layer_idx, meta.query_starts[i] * heads : meta.query_starts[i + 1] * heads]
        cache.k_rows.index_copy_(0, rows, k.reshape(-1, d))
        cache.v_rows.index_copy_(0, rows, v.reshape(-1, d))
        slot, end = meta.slots[i], meta.context_lens[i] + q.shape[0]
        return self._prefill_attend(q, cache.k[layer_idx, slot, :, :end], cache.v[layer_idx, slot, :, :end],
                                    meta.context_lens[i], meta.layer(layer_idx))

    @staticmethod
    def _decode_mask(meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor | None:
        # the kernel reads each row's length instead; layers with sinks run sdpa's masked path
        return SDPABackend._decode_mask(meta, dtype) if any(layer.sinks is not None for layer in meta.layers) else None

    def _prefill_attend(self, q, k, v, context_len: int, layer: LayerAttention) -> torch.Tensor:
        if self._bf16_prefill and q.dtype == torch.bfloat16 and not layer.variants:
            return torch.ops.kvcore.prefill_attention(q, k, v, context_len, layer.scale)
        return super()._prefill_attend(q, k, v, context_len, layer)

    @staticmethod
    def _decode_attend(qs, ks, vs, plan: SDPAPlan, layer: LayerAttention) -> torch.Tensor:
        if layer.sinks is not None:
            return SDPABackend._decode_attend(qs, ks, vs, plan, layer)
        return torch.ops.kvcore.decode_attention(qs.contiguous(), ks, vs, plan.meta.seq_lens_t, layer.scale,
                                                 layer.sliding_window or 0, layer.softcap or 0.0)


@hookimpl
def kvcore_register_backends(register):
    register(CPUDecodeBackend)
