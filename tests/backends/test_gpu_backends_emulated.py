"""The CUDA-only backends (``flash_attn2``, ``xformers``) on CPU, with emulated kernels.

flash-attn and xformers cannot run here, but everything around their kernel calls is our code: packing,
``cu_seqlens``, ``cache_seqlens`` (lengths *before* the in-place append), ``cache_batch_idx``, the
attention-bias objects, the 5-D GQA layout, the cache writes and reads. These tests run that production
glue unchanged, with the kernels swapped (``kernels=`` constructor option) for
``tests/kernel_emulation.py`` — re-implementations of each kernel's documented semantics — and compare
every output and the cache contents with the ``naive`` oracle, in float32.

The emulations are themselves checked against ``naive`` (fed by hand-built inputs, no backend glue), and
planted glue bugs are shown to make the comparison fail. Real-kernel checks live in scripts/gpu_check.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import make_random_model
from kernel_emulation import (
    FLASH_KERNELS,
    XFORMERS_KERNELS,
    EmulatedBlockDiagonalCausalMask,
    EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask,
    EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    emulated_flash_attn_varlen_func,
    emulated_flash_attn_with_kvcache,
    emulated_memory_efficient_attention,
)

import kvcore.backends.cuda_glue as cuda_glue
import kvcore.backends.xformers as xformers_mod
from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.cuda_glue import SlotPlan
from kvcore.backends.flash_attn2 import FlashAttn2Backend, FlashKVCache
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.xformers import XFormersBackend
from kvcore.errors import BackendUnavailableError, ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.plugins.registry import KV_CACHE, PluginRegistry, get_registry
from kvcore.scheduling.kv_manager import KVCacheManager

CPU = torch.device("cpu")
LAYERS = 2
HEADS = [(4, 4), (8, 2), (4, 1)]  # (H, H_kv): MHA, GQA, MQA
HEADS_IDS = ["mha", "gqa", "mqa"]


def make_backend(name: str, kernels=None):
    if name == "flash_attn2":
        return FlashAttn2Backend(kernels=kernels or FLASH_KERNELS)
    return XFormersBackend(kernels=kernels or XFORMERS_KERNELS)


BACKEND_KINDS = [(b, k) for b in ("flash_attn2", "xformers") for k in ("flash_contiguous", "contiguous")]


def cache_spec(num_kv_heads: int, head_dim: int, dtype=torch.float32, max_num_seqs: int = 6, max_seq_len: int = 256):
    return CacheSpec(LAYERS, num_kv_heads, head_dim, dtype, CPU, max_num_seqs, max_seq_len)


class Pair:
    """Drives the same calls through ``naive`` (the oracle, own contiguous cache) and a backend under test
    (own cache of ``kind``, made by the plugin registry), with identical random q/k/v, and compares every
    output. Both caches are addressed by their own :class:`KVCacheManager`, as the engine does."""

    def __init__(self, backend, kind, num_heads, num_kv_heads, head_dim, *, dtype=torch.float32, seed=0, layers=(),
                 **spec_kw):
        spec = cache_spec(num_kv_heads, head_dim, dtype, **spec_kw)
        self.layers = layers  # each layer's LayerAttention (empty: plain causal)
        self.ref, self.ref_kv = NaiveBackend(), KVCacheManager(ContiguousKVCache(spec))
        self.backend, self.kv = backend, KVCacheManager(get_registry().create_cache(kind, spec))
        assert self.cache.layout == kind and self.cache.layout in backend.capabilities.kv_layouts
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def cache(self):
        return self.kv.cache

    def add(self, *seq_ids):
        for s in seq_ids:
            self.ref_kv.add_sequence(s)
            self.kv.add_sequence(s)

    def free(self, *seq_ids):
        for s in seq_ids:
            self.ref_kv.free_sequence(s)
            self.kv.free_sequence(s)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def step(self, seq_ids, query_lens):
        """One forward call of every layer; returns the call's metadata."""
        num_heads, num_kv_heads, head_dim = self.shape
        scale = head_dim**-0.5
        meta_ref = self.ref_kv.prepare(seq_ids, query_lens, scale, self.layers)
        meta = self.kv.prepare(seq_ids, query_lens, scale, self.layers)
        assert meta.block_tables == meta_ref.block_tables  # both caches put each sequence in the same slot
        plan_ref = self.ref.plan(meta_ref, self.ref_kv.cache)  # once per call, as the model runner does
        plan = self.backend.plan(meta, self.cache)
        tokens = sum(query_lens)
        for layer in range(LAYERS):
            q = self.rand(tokens, num_heads, head_dim)
            k, v = self.rand(tokens, num_kv_heads, head_dim), self.rand(tokens, num_kv_heads, head_dim)
            want = self.ref.forward(layer, q, k, v, self.ref_kv.cache, plan_ref)
            got = self.backend.forward(layer, q.clone(), k.clone(), v.clone(), self.cache, plan)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(
                got, want, **self.tol, msg=lambda m, layer=layer: f"layer {layer}, {seq_ids} {query_lens}: {m}"
            )
        return meta

    def check_cache(self):
        assert self.ref_kv.blocks.seq_ids
        for seq_id in self.ref_kv.blocks.seq_ids:
            assert self.kv.seq_len(seq_id) == self.ref_kv.seq_len(seq_id)
            for layer in range(LAYERS):
                want_k, want_v = self.ref_kv.read(layer, seq_id)
                got_k, got_v = self.kv.read(layer, seq_id)
                torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
                torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)


def mixed_scenario(p: Pair) -> None:
    """Ragged prefill, continuing prefill, decode in permuted slot order, slot reuse, mixed batches,
    consecutive and non-consecutive slots, multi-step decode."""
    p.add(0, 1, 2, 3)
    # fresh ragged prefill (one 1-token prompt); a per-sequence layout hands out the lowest free slot
    assert p.step([0, 1, 2, 3], [5, 1, 17, 3]).slots == [0, 1, 2, 3]
    assert not p.step([0, 2], [4, 6]).is_decode  # prefill continuing a cache (context 5 and 17)
    assert p.step([3, 2, 1, 0], [1, 1, 1, 1]).slots == [3, 2, 1, 0]  # decode, slots in reverse order
    p.free(1)
    p.add(4)
    # mixed: a fresh prompt (reusing slot 1) next to a one-token continuation (not a decode step)
    meta = p.step([4, 0], [7, 1])
    assert meta.slots == [1, 0] and not meta.is_decode
    assert p.step([0, 4], [1, 1]).slots == [0, 1]  # decode over consecutive slots 0, 1
    assert p.step([2, 3], [1, 1]).slots == [2, 3]  # decode over consecutive slots 2, 3
    assert p.step([3, 0], [3, 2]).slots == [3, 0]  # continuing prefill, slots 3, 0
    for _ in range(3):
        meta = p.step([0, 2, 3, 4], [1, 1, 1, 1])  # multi-step decode, non-consecutive slots 0, 2, 3, 1
        assert meta.is_decode and meta.slots == [0, 2, 3, 1]
    p.check_cache()


# -- the backends with emulated kernels vs naive ---------------------------------------------------------
# MHA / GQA / MQA, each head size at least twice (the naive oracle is slow on 2 cores: keep it to 16 runs)
SHAPES = [((4, 4), 128), ((8, 2), 64), ((8, 2), 128), ((4, 1), 64)]


@pytest.mark.parametrize("heads,head_dim", SHAPES, ids=["mha-128", "gqa-64", "gqa-128", "mqa-64"])
@pytest.mark.parametrize("backend,kind", BACKEND_KINDS)
def test_backend_matches_naive(backend, kind, heads, head_dim):
    mixed_scenario(Pair(make_backend(backend), kind, *heads, head_dim))


@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("backend,kind", BACKEND_KINDS)
def test_decode_against_long_caches(backend, kind, heads):
    p = Pair(make_backend(backend), kind, *heads, 128, max_seq_len=320)
    p.add(0, 1, 2)
    p.step([0, 1, 2], [64, 130, 77])
    p.step([0, 2], [64, 64])  # chunked prefill continuing the cache
    p.step([0], [72])  # seq 0 now at 200 tokens
    for _ in range(4):
        p.step([2, 0, 1], [1, 1, 1])
    p.check_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend,kind", BACKEND_KINDS[::2])
def test_half_precision(backend, kind, dtype):
    """The kernels' real dtypes (naive computes in fp32, the emulations too: loose tolerance)."""
    mixed_scenario(Pair(make_backend(backend), kind, 8, 2, 64, dtype=dtype))


def test_flash_decode_appends_in_place_without_cache_write():
    """Decode leaves the K/V append to the kernel (flash_attn_with_kvcache with k/v)."""
    p = Pair(make_backend("flash_attn2"), "flash_contiguous", 4, 2, 64)
    p.add(0, 1)
    p.step([0, 1], [3, 5])
    p.cache.write = None  # any call to the cache's own write would now fail
    p.step([1, 0], [1, 1])
    p.check_cache()


def test_xformers_zero_copy_keys_for_consecutive_slots():
    backend = make_backend("xformers")
    kv = KVCacheManager(FlashKVCache(cache_spec(2, 64)))
    for s in range(3):
        kv.add_sequence(s)
    assert kv.prepare([0, 1, 2], [3, 1, 2], 0.125).slots == [0, 1, 2]
    meta = kv.prepare([1, 2], [4, 2], 0.125)  # continuing prefill over consecutive slots 1, 2
    assert meta.slots == [1, 2]
    plan = backend.plan(meta, kv.cache)
    keys, _ = XFormersBackend._padded_keys(kv.cache, 0, plan)
    assert plan.pad == kv.cache.spec.max_seq_len and keys.data_ptr() == kv.cache.k[0, 1].data_ptr()  # a view
    meta = kv.prepare([2, 0], [1, 1], 0.125)
    assert meta.slots == [2, 0]
    plan = backend.plan(meta, kv.cache)
    keys, _ = XFormersBackend._padded_keys(kv.cache, 0, plan)
    assert plan.pad == meta.max_seq_len and plan.view_from is None and keys.shape[1] == 2 * plan.pad
    assert backend.capabilities.kv_layouts[0] == "flash_contiguous"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_xformers_half_precision_reads_the_cache_where_it_lies(dtype):
    """fp16/bf16 over the flash layout: any slot order, the keys are the cache layer itself (gappy bias)."""
    seen = []

    def attention(query, key, value, **kw):
        seen.append((key.untyped_storage().data_ptr(), type(kw["attn_bias"]).__name__))
        return XFORMERS_KERNELS.memory_efficient_attention(query, key, value, **kw)

    p = Pair(make_backend("xformers", _wrap(XFORMERS_KERNELS, memory_efficient_attention=attention)),
             "flash_contiguous", 8, 2, 64, dtype=dtype)
    mixed_scenario(p)
    cache_storage = p.cache.k.untyped_storage().data_ptr()
    from_cache = [bias for ptr, bias in seen if ptr == cache_storage]
    assert from_cache and set(from_cache) == {"EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask"}
    assert len(from_cache) == len([b for _, b in seen if b != "EmulatedBlockDiagonalCausalMask"])  # no gather


# -- the emulations vs naive, with hand-built kernel inputs ---------------------------------------------
def _contiguous_kv(*args, **kwargs) -> KVCacheManager:
    return KVCacheManager(ContiguousKVCache(cache_spec(*args, **kwargs)))


def _naive_step(kv, seq_ids, query_lens, num_heads, head_dim, gen):
    """Run naive on ``kv``'s cache (layer 0); returns (meta, q, k, v, out)."""
    meta = kv.prepare(seq_ids, query_lens, head_dim**-0.5)
    t, num_kv_heads = sum(query_lens), kv.cache.spec.num_kv_heads
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    backend = NaiveBackend()
    return meta, q, k, v, backend.forward(0, q, k, v, kv.cache, backend.plan(meta, kv.cache))


def _prefix(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("heads", HEADS, ids=HEADS_IDS)
def test_emulated_varlen_matches_naive(heads):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(1)
    kv = _contiguous_kv(num_kv_heads, 64)
    for s in range(3):
        kv.add_sequence(s)
    _naive_step(kv, [0, 1], [6, 2], num_heads, 64, gen)
    meta, q, _, _, want = _naive_step(kv, [2, 0, 1], [5, 3, 1], num_heads, 64, gen)  # fresh + 2 continuing
    keys = [kv.read(0, s) for s in [2, 0, 1]]  # full per-sequence K/V after naive's write
    got = emulated_flash_attn_varlen_func(
        q,
        torch.cat([k for k, _ in keys]),
        torch.cat([v for _, v in keys]),
        cu_seqlens_q=_prefix([5, 3, 1]),
        cu_seqlens_k=_prefix([5, 9, 3]),
        max_seqlen_q=5,
        max_seqlen_k=9,
        softmax_scale=64**-0.5,
        causal=True,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["batch_idx", "block_table"])
@pytest.mark.parametrize("heads", HEADS, ids=HEADS_IDS)
def test_emulated_kvcache_matches_naive(heads, paged):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(2)
    kv = _contiguous_kv(num_kv_heads, 64, max_seq_len=300)
    for s in range(3):
        kv.add_sequence(s)
    _naive_step(kv, [0, 1, 2], [260, 7, 40], num_heads, 64, gen)
    before = {s: kv.read(0, s) for s in range(3)}
    order = [2, 0, 1]
    meta, q, k, v, want = _naive_step(kv, order, [1, 1, 1], num_heads, 64, gen)
    lens = torch.tensor([before[s][0].shape[0] for s in order], dtype=torch.int32)
    if not paged:  # cache rows in seq-id order, batch rows permuted through cache_batch_idx
        k_cache = torch.zeros(3, 300, num_kv_heads, 64)
        v_cache = torch.zeros_like(k_cache)
        for s, (kk, vv) in before.items():
            k_cache[s, : kk.shape[0]], v_cache[s, : vv.shape[0]] = kk, vv
        extra = dict(cache_batch_idx=torch.tensor(order, dtype=torch.int32))
    else:  # 256-token pages scattered over a pool by a block table
        page, blocks = 256, torch.tensor([[5, 2], [0, 4], [3, 1]], dtype=torch.int32)
        k_cache = torch.zeros(6, page, num_kv_heads, 64)
        v_cache = torch.zeros_like(k_cache)
        for row, s in enumerate(order):
            kk, vv = before[s]
            for p in range(kk.shape[0]):
                k_cache[blocks[row, p // page], p % page] = kk[p]
                v_cache[blocks[row, p // page], p % page] = vv[p]
        extra = dict(block_table=blocks)
    out = emulated_flash_attn_with_kvcache(
        q[:, None],
        k_cache,
        v_cache,
        k=k[:, None],
        v=v[:, None],
        cache_seqlens=lens,
        softmax_scale=64**-0.5,
        causal=True,
        **extra,
    )
    torch.testing.assert_close(out[:, 0], want, rtol=1e-5, atol=1e-5)
    for row, s in enumerate(order):  # the new rows landed at cache_seqlens
        pos = int(lens[row])
        idx = (s, pos) if not paged else (int(blocks[row, pos // 256]), pos % 256)
        torch.testing.assert_close(k_cache[idx], k[row])
        torch.testing.assert_close(v_cache[idx], v[row])


@pytest.mark.parametrize("heads", HEADS, ids=HEADS_IDS)
def test_emulated_xformers_matches_naive(heads):
    num_heads, num_kv_heads = heads
    group = num_heads // num_kv_heads
    gen = torch.Generator().manual_seed(3)
    kv = _contiguous_kv(num_kv_heads, 64)
    for s in range(3):
        kv.add_sequence(s)
    _, q0, k0, v0, want0 = _naive_step(kv, [0, 1], [6, 2], num_heads, 64, gen)
    fresh = EmulatedBlockDiagonalCausalMask.from_seqlens([6, 2])
    got0 = emulated_memory_efficient_attention(
        q0.reshape(1, 8, num_kv_heads, group, 64),
        k0.reshape(1, 8, num_kv_heads, 1, 64).expand(1, 8, num_kv_heads, group, 64),
        v0.reshape(1, 8, num_kv_heads, 1, 64).expand(1, 8, num_kv_heads, group, 64),
        attn_bias=fresh,
        scale=64**-0.5,
    )
    torch.testing.assert_close(got0.reshape(8, num_heads, 64), want0, rtol=1e-5, atol=1e-5)
    _, q, _, _, want = _naive_step(kv, [2, 0, 1], [5, 3, 1], num_heads, 64, gen)
    pad = 12
    keys = torch.zeros(1, 3 * pad, num_kv_heads, 64)
    values = torch.zeros_like(keys)
    for b, s in enumerate([2, 0, 1]):
        kk, vv = kv.read(0, s)
        keys[0, b * pad : b * pad + kk.shape[0]], values[0, b * pad : b * pad + vv.shape[0]] = kk, vv
    bias = EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([5, 3, 1], pad, [5, 9, 3])
    got = emulated_memory_efficient_attention(
        q.reshape(1, 9, num_kv_heads, group, 64),
        keys.unsqueeze(3).expand(1, 3 * pad, num_kv_heads, group, 64),
        values.unsqueeze(3).expand(1, 3 * pad, num_kv_heads, group, 64),
        attn_bias=bias,
        scale=64**-0.5,
    )
    torch.testing.assert_close(got.reshape(9, num_heads, 64), want, rtol=1e-5, atol=1e-5)


def test_flash_causal_mask_is_bottom_right_as_documented():
    """flash-attn's docstring: seqlen_q=2, seqlen_k=5 keeps [[1,1,1,1,0],[1,1,1,1,1]]; seqlen_q=5,
    seqlen_k=2 keeps only rows 3-4 and a fully masked row outputs zero."""
    d = 8
    k = torch.randn(5, 1, d)
    v = torch.zeros(5, 1, d)
    v[torch.arange(5), 0, torch.arange(5)] = 1.0  # value j is the one-hot e_j: output = attention weights
    q = torch.randn(2, 1, d)
    out = emulated_flash_attn_varlen_func(q, k, v, _prefix([2]), _prefix([5]), 2, 5, causal=True)
    assert (out[0, 0, :5] > 0).tolist() == [True, True, True, True, False]
    assert (out[1, 0, :5] > 0).tolist() == [True] * 5
    q5 = torch.randn(5, 1, d)
    out = emulated_flash_attn_varlen_func(q5, k[:2], v[:2], _prefix([5]), _prefix([2]), 5, 2, causal=True)
    assert out[:3].abs().max() == 0
    assert (out[3, 0, :2] > 0).tolist() == [True, False] and (out[4, 0, :2] > 0).tolist() == [True, True]


def test_flash_window_is_as_documented():
    """flash-attn's docstring: query i attends to keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q +
    right]; with causal the right side is 0; softcap caps the scaled scores."""
    d = 8
    k, v = torch.randn(7, 1, d), torch.zeros(7, 1, d)
    v[torch.arange(7), 0, torch.arange(7)] = 1.0  # one-hot values: the output is the attention weights
    q = torch.randn(3, 1, d)
    out = emulated_flash_attn_varlen_func(q, k, v, _prefix([3]), _prefix([7]), 3, 7, causal=True, window_size=(2, 0))
    assert [(row[0, :7] > 0).nonzero().flatten().tolist() for row in out] == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]
    capped = emulated_flash_attn_varlen_func(q * 100, k, v, _prefix([3]), _prefix([7]), 3, 7, softcap=1.0)
    assert capped[..., :7].min() > math.exp(-2) / 7  # |scores| <= 1: no weight below e^-2 / n


VARIANT_LAYERS = (LayerAttention(64**-0.5, sliding_window=5, softcap=1.5), LayerAttention(64**-0.5, sliding_window=1))


@pytest.mark.parametrize("kind", ["flash_contiguous", "contiguous"])
def test_flash_windows_and_softcap_match_naive(kind):
    """The glue turns each layer's window and soft-cap into flash-attn's window_size / softcap, both kernels."""
    assert {"sliding_window", "softcap"} <= FlashAttn2Backend.capabilities.decode_variants
    mixed_scenario(Pair(make_backend("flash_attn2"), kind, 8, 2, 64, layers=VARIANT_LAYERS))


def test_xformers_declares_no_variants_and_is_refused_for_them():
    caps = XFormersBackend.capabilities
    assert caps.reasons_variants({"softcap"}) == ["prefill: no soft-capping", "decode: no soft-capping"]
    assert "sinks" not in FlashAttn2Backend.capabilities.prefill_variants  # flash-attn 2 has none


def test_emulated_padded_mask_matches_docstring_example():
    """xformers' docstring: 12 key slots, kv_padding=4, kv_seqlens=[2, 3, 2]; each block bottom-right causal."""
    bias = EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2, 2], 4, [2, 3, 2])
    allowed = bias.materialize((5, 12)).exp().to(torch.int64).tolist()
    assert allowed == [
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
    ]


@pytest.mark.skipif(importlib.util.find_spec("xformers") is None, reason="xformers not installed")
def test_emulated_masks_match_real_xformers_materialize():
    """Where xformers is importable (its bias classes work on CPU), our masks equal its own materialize()."""
    from xformers.ops.fmha import attn_bias as real

    cases = [([2, 1, 3], 5, [4, 3, 3]), ([1, 1], 7, [7, 1]), ([3], 3, [3])]
    for q_lens, pad, kv_lens in cases:
        shape = (sum(q_lens), pad * len(q_lens))
        ours = EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q_lens, pad, kv_lens)
        theirs = real.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q_lens, pad, kv_lens, device=CPU)
        assert torch.equal(ours.materialize(shape), theirs.materialize(shape))
    for q_lens, starts, kv_lens in [([1, 2, 1], [8, 0, 4, 12], [3, 4, 2]), ([2], [5, 9], [4])]:
        shape = (sum(q_lens), starts[-1])
        ours = EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q_lens, starts, kv_lens)
        theirs = real.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q_lens, starts, kv_lens, device=CPU)
        assert torch.equal(ours.materialize(shape), theirs.materialize(shape))
    ours = EmulatedBlockDiagonalCausalMask.from_seqlens([3, 1, 4])
    theirs = real.BlockDiagonalCausalMask.from_seqlens([3, 1, 4], device=CPU)
    assert torch.equal(ours.materialize((8, 8)), theirs.materialize((8, 8)))


@pytest.mark.skipif(importlib.util.find_spec("xformers") is None, reason="xformers not installed")
@pytest.mark.parametrize("kind", ["flash_contiguous", "contiguous"])
def test_xformers_glue_with_real_bias_classes(kind):
    """The backend builds xformers' *real* bias objects (keyword names, device) and the emulated kernel
    attends through their own materialize(): checks our from_seqlens calls against the real signatures."""
    from xformers.ops.fmha import attn_bias as real

    kernels = _wrap(
        XFORMERS_KERNELS,
        BlockDiagonalCausalMask=real.BlockDiagonalCausalMask,
        BlockDiagonalCausalWithOffsetPaddedKeysMask=real.BlockDiagonalCausalWithOffsetPaddedKeysMask,
        BlockDiagonalCausalWithOffsetGappyKeysMask=real.BlockDiagonalCausalWithOffsetGappyKeysMask,
    )
    for dtype in (torch.float32, torch.bfloat16):  # padded-keys and gappy-keys biases
        mixed_scenario(Pair(make_backend("xformers", kernels), kind, 8, 2, 64, dtype=dtype))


def test_emulations_are_strict_where_the_kernels_would_silently_misbehave():
    q, k = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        emulated_flash_attn_varlen_func(q, k, k, _prefix([3, 3]), _prefix([3, 2]), 3, 3, causal=True)
    with pytest.raises(ValueError, match="int32"):
        emulated_flash_attn_varlen_func(q, k, k, _prefix([3, 3]).long(), _prefix([3, 3]), 3, 3)
    with pytest.raises(ValueError, match="max_seqlen"):
        emulated_flash_attn_varlen_func(q, k, k, _prefix([4, 2]), _prefix([4, 2]), 3, 4)
    with pytest.raises(NotImplementedError):
        emulated_flash_attn_varlen_func(q, k, k, _prefix([6]), _prefix([6]), 6, 6, dropout_p=0.1)
    kc = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match="past the end"):
        emulated_flash_attn_with_kvcache(
            q[:2, None],
            kc,
            kc.clone(),
            k=k[:2, None],
            v=k[:2, None],
            cache_seqlens=torch.tensor([16, 0], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="divisible by 256"):
        emulated_flash_attn_with_kvcache(
            q[:1, None],
            kc,
            kc.clone(),
            cache_seqlens=torch.tensor([3], dtype=torch.int32),
            block_table=torch.zeros(1, 2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="incompatible"):  # xformers does not broadcast GQA K/V
        emulated_memory_efficient_attention(
            torch.randn(1, 4, 2, 2, 8), torch.randn(1, 4, 2, 1, 8), torch.randn(1, 4, 2, 1, 8)
        )


# -- planted glue bugs must make the comparison fail ----------------------------------------------------
def _wrap(kernels, **overrides):
    ns = SimpleNamespace(**vars(kernels))
    for name, fn in overrides.items():
        setattr(ns, name, fn)
    return ns


def _varlen_cu_k_off_by_one(*args, cu_seqlens_k, **kw):
    bad = cu_seqlens_k.clone()
    bad[1:-1] += 1
    return emulated_flash_attn_varlen_func(*args, cu_seqlens_k=bad, **kw)


def _kvcache_lengths_after_append(*args, cache_seqlens, **kw):
    return emulated_flash_attn_with_kvcache(*args, cache_seqlens=cache_seqlens + 1, **kw)


class _PaddedMaskDropsLastKey(EmulatedBlockDiagonalCausalWithOffsetPaddedKeysMask):
    @classmethod
    def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen, causal_diagonal=None, *, device=None):
        return cls(q_seqlen, kv_padding, [n - 1 for n in kv_seqlen], device)


class _GappyMaskShiftsStarts(EmulatedBlockDiagonalCausalWithOffsetGappyKeysMask):
    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqstarts, kv_seqlen, *, device=None):
        return cls(q_seqlen, [s + 1 for s in kv_seqstarts[:-1]] + [kv_seqstarts[-1]], kv_seqlen, device)


# a planted bug is "caught" when the run fails: an output/cache mismatch, or a kernel-argument or shape error
CAUGHT = (AssertionError, ValueError, RuntimeError, IndexError)

PLANTED = {
    "flash cu_seqlens_k off by one": ("flash_attn2", dict(flash_attn_varlen_func=_varlen_cu_k_off_by_one)),
    "flash cache_seqlens after append": ("flash_attn2", dict(flash_attn_with_kvcache=_kvcache_lengths_after_append)),
    "xformers kv_seqlen off by one": (
        "xformers",
        dict(BlockDiagonalCausalWithOffsetPaddedKeysMask=_PaddedMaskDropsLastKey),
    ),
}


def test_planted_gappy_start_bug_is_caught():
    kernels = _wrap(XFORMERS_KERNELS, BlockDiagonalCausalWithOffsetGappyKeysMask=_GappyMaskShiftsStarts)
    with pytest.raises(CAUGHT):
        mixed_scenario(Pair(make_backend("xformers", kernels), "flash_contiguous", 8, 2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_kernel_argument_bugs_are_caught(bug):
    name, overrides = PLANTED[bug]
    base = FLASH_KERNELS if name == "flash_attn2" else XFORMERS_KERNELS
    pair = Pair(make_backend(name, _wrap(base, **overrides)), "flash_contiguous", 8, 2, 64)
    with pytest.raises(CAUGHT):
        mixed_scenario(pair)


def test_planted_cu_seqlens_helper_bug_is_caught(monkeypatch):
    real = cuda_glue.cu_seqlens  # where the slot plan computes the keys' offsets
    monkeypatch.setattr(cuda_glue, "cu_seqlens", lambda lens, device: real([n + 1 for n in lens], device) - 1)
    with pytest.raises(CAUGHT):
        mixed_scenario(Pair(make_backend("flash_attn2"), "flash_contiguous", 4, 4, 64))


def test_planted_gqa_grouping_bug_is_caught(monkeypatch):
    def grouped_wrong(query, keys, values):  # query head h = j * G + g instead of g * (H / G) + j
        b, mq, num_heads, d = query.shape
        g = keys.shape[2]
        query = query.reshape(b, mq, num_heads // g, g, d).transpose(2, 3)
        mk = keys.shape[1]
        return query, *(x.unsqueeze(3).expand(b, mk, g, num_heads // g, d) for x in (keys, values))

    monkeypatch.setattr(xformers_mod, "_grouped", grouped_wrong)
    with pytest.raises(AssertionError):
        mixed_scenario(Pair(make_backend("xformers"), "flash_contiguous", 8, 2, 64))


# -- availability, registration, validation ---------------------------------------------------------------
@pytest.mark.parametrize("cls,package", [(FlashAttn2Backend, "flash_attn"), (XFormersBackend, "xformers")])
def test_availability_here_is_one_line_reason(cls, package):
    reason = cls.availability()
    if importlib.util.find_spec(package) is None:
        assert reason.startswith(f"package '{package}' is not installed (pip install")
        assert "docs/gpu-backends.md" in reason
    elif not torch.cuda.is_available():
        assert reason == "no CUDA device (torch.cuda.is_available() is False)"
    if reason is not None:
        assert "\n" not in reason


PRETENDED = ("flash_attn", "flash_attn_2_cuda", "xformers")


def _pretend_installed(monkeypatch):
    real = importlib.util.find_spec
    fake = SimpleNamespace(name="fake")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **kw: fake if name in PRETENDED else real(name, *a, **kw),
    )


def test_availability_reasons_for_each_missing_piece(monkeypatch):
    _pretend_installed(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert FlashAttn2Backend.availability() == "no CUDA device (torch.cuda.is_available() is False)"
    assert XFormersBackend.availability() == "no CUDA device (torch.cuda.is_available() is False)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert FlashAttn2Backend.availability() == "GPU compute capability 7.5 < 8.0 (sm80+ required)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (5, 2))
    assert XFormersBackend.availability() == "GPU compute capability 5.2 < 6.0 (sm60+ required)"
    for cc in [(9, 0), (12, 0)]:  # flash-attn 2.8 checks cc_major >= 8 only (Blackwell too)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        reason = FlashAttn2Backend.availability()
        assert reason is None or "compute capability" not in reason
    if not _really_installed("flash_attn"):
        reason = FlashAttn2Backend.availability()  # passes every check, then the import fails
        assert reason.startswith("package 'flash_attn' is installed but failed to import") and "\n" not in reason


def _fake_flash(root, *, extension: bool, functions=("flash_attn_varlen_func", "flash_attn_with_kvcache")):
    """A ``flash_attn`` on sys.path: a namespace folder (what flash-attn-4 leaves), or a package with
    ``functions`` and, with ``extension``, a ``flash_attn_2_cuda`` module beside it."""
    pkg = root / "flash_attn"
    pkg.mkdir()
    if functions is not None:
        body = "__version__ = '2.8.3'\n" + "".join(f"def {f}(*a, **kw): pass\n" for f in functions)
        (pkg / "__init__.py").write_text(body)
    if extension:
        (root / "flash_attn_2_cuda.py").write_text("")


NO_EXTENSION = "'flash_attn' is there but its CUDA extension 'flash_attn_2_cuda' is not"


@pytest.mark.parametrize(
    "layout, want",
    [
        (dict(extension=False, functions=None), NO_EXTENSION),
        (dict(extension=False), NO_EXTENSION),
        (dict(extension=True, functions=("flash_attn_varlen_func",)), "flash_attn 2.8.3 has no flash_attn_with_"),
        (dict(extension=True), None),
    ],
    ids=["namespace", "no-extension", "missing-function", "complete"],
)
def test_flash_attn2_checks_the_real_extension_not_the_namespace(monkeypatch, tmp_path, layout, want):
    if _really_installed("flash_attn"):
        pytest.skip("a real flash_attn is installed here")
    _fake_flash(tmp_path, **layout)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU checks pass: the package decides
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        reason = FlashAttn2Backend.availability()
    finally:
        sys.modules.pop("flash_attn", None)  # the fake must not outlive this test
    assert reason == want if want is None else reason.startswith(want) and "\n" not in reason


def test_xformers_dtypes_follow_the_compute_capability(monkeypatch):
    """fp32 has one xformers operator (cutlassF, sm60-sm90) and bf16 needs sm80: declared, and refused with
    a reason elsewhere."""
    caps = XFormersBackend.capabilities
    assert caps.dtypes_on((9, 0)) == {torch.float32, torch.float16, torch.bfloat16}
    assert caps.dtypes_on((10, 0)) == {torch.float16, torch.bfloat16}
    assert caps.dtypes_on((7, 5)) == {torch.float32, torch.float16}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    xf, cuda = make_backend("xformers"), torch.device("cuda")
    shape = dict(device=cuda, head_dim=64, num_heads=8, num_kv_heads=2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "dtype float32 is not served on compute capability 10.0 (sm60-sm90)" in caps.reasons_unsupported(
        dtype=torch.float32, **shape
    )
    assert not caps.reasons_unsupported(dtype=torch.bfloat16, **shape)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    reasons = xf.validate(dtype=torch.bfloat16, **shape)
    assert "dtype bfloat16 is not served on compute capability 7.5 (sm80+)" in reasons


def _really_installed(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


def test_availability_never_raises(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("driver exploded\nsecond line")

    monkeypatch.setattr(importlib.util, "find_spec", boom)
    for cls in (FlashAttn2Backend, XFormersBackend):
        reason = cls.availability()
        assert reason == "availability check failed: RuntimeError: driver exploded"


def test_registered_as_builtins_with_their_cache_layout():
    registry = PluginRegistry(load_entrypoints=False)
    assert registry.get("flash_attn2").cls is FlashAttn2Backend
    assert registry.get("xformers").cls is XFormersBackend
    flash_cache = registry.get("flash_contiguous", KV_CACHE)
    assert flash_cache.cls is FlashKVCache and flash_cache.plugin == "kvcore.backends.flash_attn2"
    assert FlashKVCache.layout == "flash_contiguous" and not FlashKVCache.paged
    for cls in (FlashAttn2Backend, XFormersBackend):  # their own layout first, and the shared one
        assert cls.capabilities.kv_layouts == ("flash_contiguous", "contiguous")
    if FlashAttn2Backend.availability() is not None:
        with pytest.raises(BackendUnavailableError, match="backend 'flash_attn2' is unavailable: "):
            registry.create("flash_attn2")
    with pytest.raises(ConfigError, match="testing hook"):
        FlashAttn2Backend(kernels="emulated")
    with pytest.raises(ConfigError, match="got unknown options"):
        XFormersBackend(block_size=16)


def test_validate_reports_shape_limits():
    flash, xf = make_backend("flash_attn2"), make_backend("xformers")
    cuda = torch.device("cuda")
    ok = dict(device=cuda, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2)
    assert not [r for r in flash.validate(head_dim=128, **ok) if "head_dim" in r]
    assert "head_dim 260 exceeds the maximum 256" in flash.validate(head_dim=260, **ok)
    assert "head_dim 20 is not a multiple of 8" in flash.validate(head_dim=20, **ok)
    assert "head_dim 20 is not a multiple of 8" in xf.validate(head_dim=20, **ok)
    fp32 = flash.validate(device=cuda, dtype=torch.float32, head_dim=64, num_heads=8, num_kv_heads=2)
    assert any("dtype float32 not supported" in r for r in fp32)
    assert not any(
        "dtype" in r for r in xf.validate(device=cuda, dtype=torch.float32, head_dim=64, num_heads=8, num_kv_heads=2)
    )
    cpu = xf.validate(device=CPU, dtype=torch.float16, head_dim=64, num_heads=8, num_kv_heads=2)
    assert any("device 'cpu' not supported" in r for r in cpu)


def test_flash_kvcache_bookkeeping():
    """The flash layout under the core's block manager: one slot per sequence, a fork shares the slot
    until the child writes (copy-on-write through ``copy_blocks``), capacity and context limits."""
    kv = KVCacheManager(FlashKVCache(cache_spec(2, 16, max_num_seqs=2, max_seq_len=8)))
    assert kv.cache.storage_shape() == (2, 2, 8, 2, 16) and kv.cache.k.shape == (2, 2, 8, 2, 16)
    kv.add_sequence(7)
    meta = kv.prepare([7], [3], 0.25)
    k = torch.randn(3, 2, 16)
    kv.cache.write(0, k, -k, meta)
    kv.fork_sequence(7, 8)
    assert kv.blocks.block_table(8) == kv.blocks.block_table(7)  # shared, nothing copied yet
    assert torch.equal(kv.read(0, 8)[0], k) and torch.equal(kv.read(0, 8)[1], -k)
    child = kv.prepare([8], [1], 0.25)  # the child's first write lands in the shared slot: copied first
    assert kv.blocks.block_table(8) != kv.blocks.block_table(7)
    new = torch.randn(1, 2, 16)
    kv.cache.write(0, new, -new, child)
    assert torch.equal(kv.read(0, 8)[0], torch.cat([k, new])) and torch.equal(kv.read(0, 8)[1], -torch.cat([k, new]))
    assert torch.equal(kv.read(0, 7)[0], k) and torch.equal(kv.read(0, 7)[1], -k)  # the parent is untouched
    assert not kv.can_add_sequence() and not kv.can_reserve([7], [6])  # no free slot; 3 + 6 > max_seq_len 8
    assert kv.can_reserve([7], [5])
    plan = make_backend("flash_attn2").plan(meta, kv.cache)
    assert isinstance(plan, SlotPlan) and plan.slots_i32.dtype == torch.int32 and plan.slots_i32.tolist() == [0]
    assert plan.context_lens_i32.dtype == torch.int32
    kv.free_sequence(7)
    assert kv.can_add_sequence() and kv.cache.kv_bytes_allocated == 2 * 2 * 2 * 8 * 2 * 16 * 4


# -- end to end through the engine ----------------------------------------------------------------------
def _emulated(cls, name):
    caps = dataclasses.replace(cls.capabilities, devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
    kernels = FLASH_KERNELS if cls is FlashAttn2Backend else XFORMERS_KERNELS

    def init(self, **options):
        cls.__init__(self, kernels=kernels, **options)

    return type(
        name,
        (cls,),
        {"name": name, "capabilities": caps, "availability": classmethod(lambda c: None), "__init__": init},
    )


class _EmulatedPlugin:
    @hookimpl
    def kvcore_register_backends(self, register):
        register(_emulated(FlashAttn2Backend, "flash_attn2_emulated"))
        register(_emulated(XFormersBackend, "xformers_emulated"))


@pytest.fixture(scope="module")
def registry():
    reg = PluginRegistry(load_entrypoints=False)
    reg.backends  # noqa: B018 - load the built-ins first (they load only into an empty registry)
    reg.register_plugin(_EmulatedPlugin(), name="emulated")
    try:
        yield reg
    finally:
        reg.unregister_plugin("emulated")


PROMPTS = [[1, 5, 9, 13, 17], [7, 8], list(range(10, 50)), [9]]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _generate(model, registry, layout, **cfg):
    engine = Engine(model, None, EngineConfig(max_model_len=96, **cfg), registry=registry)
    assert engine.cache.layout == layout
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def model():
    return make_random_model(num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def naive_streams(model, registry):
    return _generate(model, registry, "contiguous", backend="naive")


@pytest.mark.parametrize(
    "layout, cfg",
    [
        ("flash_contiguous", dict(backend="flash_attn2_emulated")),
        ("flash_contiguous", dict(backend="xformers_emulated")),
        ("contiguous", dict(backend="flash_attn2_emulated", kv_cache="contiguous")),
        ("contiguous", dict(backend="xformers_emulated", kv_cache="contiguous")),
        ("contiguous", dict(prefill_backend="flash_attn2_emulated", decode_backend="naive")),  # the shared layout
        ("flash_contiguous", dict(prefill_backend="xformers_emulated", decode_backend="flash_attn2_emulated")),
    ],
    ids=["flash", "xformers", "flash-contiguous", "xformers-contiguous", "flash+naive", "xformers+flash"],
)
def test_engine_greedy_matches_naive(model, registry, naive_streams, layout, cfg):
    assert _generate(model, registry, layout, **cfg) == naive_streams


def test_engine_refuses_a_paged_cache_for_the_slot_backends(model, registry):
    for backend in ("flash_attn2_emulated", "xformers_emulated"):
        with pytest.raises(ConfigError, match=rf"layout 'paged', which backend '{backend}' cannot read"):
            Engine(model, None, EngineConfig(backend=backend, kv_cache="paged"), registry=registry)
