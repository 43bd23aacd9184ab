"""``cached_decode_attention`` with several query tokens per sequence (csrc/decode_attention.cpp): a speculative
verification's ``[last, d1..dK]`` after a cached context, each token attending to its own causal length, in one
call that writes the tokens' K/V rows too. Checked against a float64 reference for 1/2/5/9/16 rows, windows and
soft-caps, float32 and bfloat16, split-K contexts, two head sizes; bit for bit against the one-row kernel run per
row; planted bugs (a row seeing one key too many or too few) caught; and through the cpu_decode backend against
sdpa for verification, ragged and mixed batches."""

from __future__ import annotations

import pytest
import torch
from helpers import make_random_model

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.backends.sdpa import SDPABackend
from kvcore.execution.runner import run_model
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.kernels.cpu_kernels import load_kernels

pytestmark = pytest.mark.skipif(CPUDecodeBackend.availability() is not None, reason="no C++ toolchain here")

LAYERS, SLOTS, KV_HEADS, GROUP, S_MAX, SLOT = 2, 3, 2, 3, 320, 1


@pytest.fixture(autouse=True)
def kernels():
    load_kernels()


def _case(rows: int, ctx: int, d: int, dtype: torch.dtype, seed: int = 0):
    """A random cache (``ctx`` keys of slot ``SLOT`` meaningful, the rest noise) and ``rows`` new tokens."""
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, SLOTS, KV_HEADS, S_MAX, d)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    q = torch.randn(rows, KV_HEADS * GROUP, d, generator=gen).to(dtype)
    k, v = (torch.randn(rows, KV_HEADS, d, generator=gen).to(dtype) for _ in range(2))
    # the plan's rows of layer 1, slot SLOT, positions ctx .. ctx + rows - 1: [L, rows * H_kv]
    pos = torch.arange(ctx, ctx + rows)[:, None]
    cache_rows = ((SLOT * KV_HEADS + torch.arange(KV_HEADS)) * S_MAX + pos).flatten()
    cache_rows = cache_rows + torch.arange(LAYERS)[:, None] * SLOTS * KV_HEADS * S_MAX
    return q, k, v, caches, cache_rows


def _run(q, k, v, caches, cache_rows, seq_len: int, layer: LayerAttention) -> torch.Tensor:
    return torch.ops.kvcore.cached_decode_attention(
        q, k, v, caches[0], caches[1], cache_rows, torch.tensor([seq_len], dtype=torch.int32), 1, SLOT, seq_len,
        layer.scale, layer.sliding_window or 0, layer.softcap or 0.0)


def _reference(q, caches, ctx: int, layer: LayerAttention) -> torch.Tensor:
    """Float64 attention of each token (position ctx + t) over keys ``0 .. ctx + t`` (its window) of the cache."""
    rows, heads, d = q.shape
    keys = caches[0][1, SLOT].double().repeat_interleave(GROUP, 0)  # [H, S_max, D]
    values = caches[1][1, SLOT].double().repeat_interleave(GROUP, 0)
    scores = torch.einsum("thd,hsd->hts", q.double(), keys) * layer.scale
    if layer.softcap:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    pos, key = torch.arange(ctx, ctx + rows)[:, None], torch.arange(S_MAX)[None, :]
    visible = (key <= pos) & ((key > pos - layer.sliding_window) if layer.sliding_window else True)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,hsd->thd", probs, values)


def _matches(got, want, dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    return torch.allclose(got.double(), want, rtol=tol, atol=tol)


VARIANTS = [(None, None), (7, None), (None, 1.5), (40, 2.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16])
def test_rows_attend_to_their_own_causal_length(dtype, window, softcap, rows):
    ctx = 290  # past one split-K chunk: the chunks' merge runs for every row
    for d in (64, 40):  # bfloat16's vdpbf16ps path (whole 32-dim vectors) and the widening one
        q, k, v, caches, cache_rows = _case(rows, ctx, d, dtype, seed=rows)
        layer = LayerAttention(d**-0.5 * 3, sliding_window=window, softcap=softcap)  # scores O(3): the cap bites
        got = _run(q, k, v, caches, cache_rows, ctx + rows, layer)
        # the write: the tokens' K/V at their positions of layer 1, slot SLOT, nothing else touched
        assert torch.equal(caches[0][1, SLOT, :, ctx : ctx + rows], k.transpose(0, 1))
        assert torch.equal(caches[1][1, SLOT, :, ctx : ctx + rows], v.transpose(0, 1))
        assert _matches(got, _reference(q, caches, ctx, layer), dtype), (d, (got.double() - _reference(
            q, caches, ctx, layer)).abs().max())


def _one_row_each(q, k, v, caches, cache_rows, ctx: int, layer: LayerAttention) -> list[torch.Tensor]:
    """Each token of a verification row run alone, as the one-token decode step at its position runs it."""
    return [torch.ops.kvcore.cached_decode_attention(
        q[t : t + 1], k[t : t + 1], v[t : t + 1], caches[0], caches[1],
        cache_rows[:, t * KV_HEADS : (t + 1) * KV_HEADS], torch.tensor([ctx + t + 1], dtype=torch.int32), 1, SLOT,
        ctx + t + 1, layer.scale, layer.sliding_window or 0, layer.softcap or 0.0)[0] for t in range(q.shape[0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", VARIANTS)
@pytest.mark.parametrize("ctx", [150, 250, 290])
def test_rows_compute_the_one_row_kernel_bit_for_bit(dtype, window, softcap, ctx):
    """Each row is what the one-row kernel gives for that row's length, bit for bit: within one split-K chunk,
    across a chunk boundary the rows straddle (250 + 9 rows), past it (the chunks' merge) and with windows, at one
    and at two threads (the chunks must not follow the rows' lengths or the thread count)."""
    rows, d = 9, 64
    layer = LayerAttention(d**-0.5, sliding_window=window, softcap=softcap)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            q, k, v, caches, cache_rows = _case(rows, ctx, d, dtype)
            got = _run(q, k, v, caches, cache_rows, ctx + rows, layer)
            for t, one in enumerate(_one_row_each(q, k, v, caches, cache_rows, ctx, layer)):
                assert torch.equal(got[t], one), (num_threads, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bug", ["one key too many", "one key too few"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_seeing_one_position_off_is_caught(bug, dtype):
    """The checks above fail a kernel whose rows read one key past (or short of) their causal length: the
    same call with every row's length moved by one."""
    rows, ctx, d = 5, 290, 64
    q, k, v, caches, cache_rows = _case(rows, ctx, d, dtype)
    layer = LayerAttention(d**-0.5 * 3)
    off = 1 if bug == "one key too many" else -1
    # the cache rows of the tokens stay where they are; only the lengths the rows read move
    got = _run(q, k, v, caches, cache_rows, ctx + rows + off, layer)
    assert not _matches(got, _reference(q, caches, ctx, layer), dtype)


def test_bad_row_counts_are_refused_with_a_message():
    q, k, v, caches, cache_rows = _case(4, 10, 16, torch.float32)
    op = torch.ops.kvcore.cached_decode_attention
    with pytest.raises(RuntimeError, match="seq_lens out of range 4"):
        op(q, k, v, caches[0], caches[1], cache_rows, torch.tensor([3], dtype=torch.int32), 1, SLOT, 14, 0.25)
    with pytest.raises(RuntimeError, match="the same number of tokens"):
        op(q[:3], k[:3], v[:3], caches[0], caches[1], cache_rows[:, :6], torch.tensor([13, 13], dtype=torch.int32),
           1, SLOT, 14, 0.25)
    q, k, v, caches, cache_rows = _case(17, 10, 16, torch.float32)
    with pytest.raises(RuntimeError, match="1..16 query tokens per sequence"):
        op(q, k, v, caches[0], caches[1], cache_rows, torch.tensor([27], dtype=torch.int32), 1, SLOT, 27, 0.25)


HEAD_DIM = 32


def _model(dtype: torch.dtype):
    model = make_random_model(num_layers=4, head_dim=HEAD_DIM, num_kv_heads=2, dtype=dtype)
    scale = HEAD_DIM**-0.5
    model.attention_layers = (
        LayerAttention(scale, sliding_window=5),
        LayerAttention(scale * 4, softcap=2.0),
        LayerAttention(scale),
        LayerAttention(scale, sinks=torch.linspace(-1.0, 1.0, 4)),  # sdpa's path
    )
    return model


def _steps(model, backend, steps: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Forward calls of ``(query_lens, context_lens)`` on slots 1, 2, ...: each call's hidden states."""
    spec = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=HEAD_DIM, dtype=model.dtype,
                     device=torch.device("cpu"), max_num_seqs=4, max_seq_len=64)
    cache, gen, hidden = ContiguousKVCache(spec), torch.Generator().manual_seed(0), []
    for query_lens, context_lens in steps:
        tables = [[i + 1] for i in range(len(query_lens))]
        meta = AttentionMetadata.build(query_lens, context_lens, tables, cache.block_size, HEAD_DIM**-0.5,
                                       torch.device("cpu"), model.attention_layers)
        ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=gen)
        hidden.append(run_model(model, backend, cache, meta, ids))
    return hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_verifies_rows_as_sdpa_does(dtype, monkeypatch):
    """Prefills, then a batch of verifications of 9 and 3 rows, then one that mixes a prefill chunk of 20 rows
    (the prefill path) with a verification of 16: sdpa's hidden states, with one call per short sequence and
    layer without sinks."""
    steps = [([12, 7], [0, 0]), ([9, 3], [12, 7]), ([20, 16], [21, 10])]
    model, op, calls = _model(dtype), torch.ops.kvcore.cached_decode_attention, []
    monkeypatch.setattr(torch.ops.kvcore, "cached_decode_attention",
                        lambda *args: calls.append((args[0].shape[0], args[7])) or op(*args))
    got = _steps(model, CPUDecodeBackend(), steps)
    assert calls == [(n, layer) for layer in range(3) for n in (9, 3)] + [(16, layer) for layer in range(3)]
    want = _steps(model, SDPABackend(), steps)
    if dtype == torch.float32:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return
    # bfloat16: the kernel (its AVX512_BF16 or its AVX2 path) and sdpa round differently, each some bfloat16 steps
    # of the hidden states' scale off the float32 model; a wrong row, mask or scale is off by that scale itself
    exact = _steps(_model(torch.float32), SDPABackend(), steps)
    for a, b, r in zip(got, want, exact):
        scale = float(r.abs().max())
        assert float((b.float() - r).abs().max()) <= 2**-3 * scale  # the same model, rounded
        assert float((a.float() - b.float()).abs().max()) <= 2**-5 * scale
        assert float((a.float() - r).abs().max()) <= 1.5 * float((b.float() - r).abs().max()) + 2**-7 * scale
