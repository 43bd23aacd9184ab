"""cpu_decode's one call per decode layer (``cached_decode_attention``, csrc/decode_attention.cpp) against the sdpa
path it replaces (two ``index_copy_`` cache writes, the cache views, ``decode_attention``): the same cache contents
and hidden states bit for bit over several decode steps of a ragged batch, in float32 and bfloat16, with a
sliding-window layer, a soft-capped one, a plain one and one with sinks (which keeps sdpa's path)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_random_model

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.execution.runner import run_model
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.kernels.cpu_kernels import load_kernels

pytestmark = pytest.mark.skipif(CPUDecodeBackend.availability() is not None, reason="no C++ toolchain here")

HEAD_DIM, KV_HEADS, STEPS = 32, 2, 4
PROMPTS = [9, 3, 14]  # a ragged batch: each step's rows read different numbers of keys
TABLES = [[1], [2], [3]]  # consecutive slots, not starting at 0


@pytest.fixture(autouse=True)
def kernels():
    load_kernels()


def _model(dtype: torch.dtype):
    model = make_random_model(num_layers=4, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, dtype=dtype)
    scale = HEAD_DIM**-0.5
    model.attention_layers = (
        LayerAttention(scale, sliding_window=5),  # shorter than every row: it hides keys
        LayerAttention(scale * 4, softcap=2.0),  # scores of a few units: the cap bites
        LayerAttention(scale),
        LayerAttention(scale, sinks=torch.linspace(-1.0, 1.0, 4)),
    )
    return model


def _decode(model, backend) -> tuple[list[torch.Tensor], ContiguousKVCache]:
    """A prefill of ``PROMPTS`` then ``STEPS`` decode steps: each step's hidden states, and the cache."""
    spec = CacheSpec(num_layers=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=model.dtype,
                     device=torch.device("cpu"), max_num_seqs=4, max_seq_len=32)
    cache = ContiguousKVCache(spec)
    gen = torch.Generator().manual_seed(0)
    lens, query_lens, hidden = [0] * len(PROMPTS), list(PROMPTS), []
    for _ in range(STEPS + 1):
        meta = AttentionMetadata.build(query_lens, lens, TABLES, cache.block_size, HEAD_DIM**-0.5,
                                       torch.device("cpu"), model.attention_layers)
        ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=gen)
        hidden.append(run_model(model, backend, cache, meta, ids))
        lens, query_lens = [c + q for c, q in zip(lens, query_lens)], [1] * len(PROMPTS)
    return hidden, cache


def _compare(dtype: torch.dtype, monkeypatch) -> bool:
    """Whether the per-layer call gives sdpa's path's hidden states and cache bit for bit; asserts it was called
    for every decode layer without sinks, and never on sdpa's path."""
    model, op, calls = _model(dtype), torch.ops.kvcore.cached_decode_attention, []
    monkeypatch.setattr(torch.ops.kvcore, "cached_decode_attention",
                        lambda *args: calls.append(args[7]) or op(*args))
    fused, fused_cache = _decode(model, CPUDecodeBackend())
    assert calls == [0, 1, 2] * STEPS  # layer 3 has sinks: sdpa's masked path
    sdpa_path = CPUDecodeBackend()
    sdpa_path.cached_decode = False
    reference, reference_cache = _decode(model, sdpa_path)
    assert len(calls) == 3 * STEPS
    return (all(torch.equal(a, b) for a, b in zip(fused, reference))
            and torch.equal(fused_cache.k, reference_cache.k) and torch.equal(fused_cache.v, reference_cache.v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_per_layer_computes_the_sdpa_path_bit_for_bit(dtype, monkeypatch):
    assert _compare(dtype, monkeypatch)


@pytest.mark.parametrize("bug", ["row one position on", "the previous layer's rows"])
def test_a_planted_bug_is_caught(bug, monkeypatch):
    op = torch.ops.kvcore.cached_decode_attention

    def planted(q, k, v, k_cache, v_cache, rows, *rest):
        return op(q, k, v, k_cache, v_cache, rows + 1 if bug.startswith("row") else rows.roll(1, 0), *rest)

    monkeypatch.setattr(torch.ops.kvcore, "cached_decode_attention", planted)
    assert not _compare(torch.bfloat16, monkeypatch)


def test_the_call_rejects_bad_inputs_with_a_message():
    q, k = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    cache = torch.zeros(3, 4, 2, 8, 16)
    rows = torch.zeros(3, 4, dtype=torch.long)
    lens = torch.tensor([1, 1], dtype=torch.int32)
    op = torch.ops.kvcore.cached_decode_attention
    with pytest.raises(RuntimeError, match="out of range 0..191"):
        op(q, k, k, cache, cache.clone(), rows + 192, lens, 0, 0, 8, 0.25)
    with pytest.raises(RuntimeError, match="layer, slots or max_len out of range"):
        op(q, k, k, cache, cache.clone(), rows, lens, 0, 3, 8, 0.25)  # slots 3 and 4 of 4
    with pytest.raises(RuntimeError, match=r"rows must be int64 \[L, T \* H_kv\]"):
        op(q, k, k, cache, cache.clone(), rows[:, :2], lens, 0, 0, 8, 0.25)
    with pytest.raises(RuntimeError, match="of the cache's dtype"):
        op(q, k.bfloat16(), k, cache, cache.clone(), rows, lens, 0, 0, 8, 0.25)


def test_the_layer_arguments_are_made_once_per_model_and_again_for_another():
    """The plan's per-layer arguments and the decode stack's, one cache of both: reused while the metadata carries
    the same layers, rebuilt together for another model's layers, another scale or another layer count."""
    backend, scale = CPUDecodeBackend(), HEAD_DIM**-0.5
    spec = CacheSpec(num_layers=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                     device=torch.device("cpu"), max_num_seqs=4, max_seq_len=32)
    cache = ContiguousKVCache(spec)

    def plan(layers, scale=scale, cache=cache):
        meta = AttentionMetadata.build([1, 1], [5, 7], [[1], [2]], cache.block_size, scale, torch.device("cpu"),
                                       layers)
        return backend.plan(meta, cache)

    plain = tuple(LayerAttention(scale) for _ in range(4))
    first, again = plan(plain), plan(plain)
    assert first.layer_args is again.layer_args and first.stack_args is again.stack_args
    assert first.stack_args == ((scale,) * 4, (0,) * 4, (0.0,) * 4)
    variants = _model(torch.bfloat16).attention_layers[:3] + (LayerAttention(scale * 2, softcap=3.0),)
    other = plan(variants)
    assert other.layer_args == ((scale, 5, 0.0), (scale * 4, 0, 2.0), (scale, 0, 0.0), (scale * 2, 0, 3.0))
    assert other.stack_args == ((scale, scale * 4, scale, scale * 2), (5, 0, 0, 0), (0.0, 2.0, 0.0, 3.0))
    stack = backend.decode_stack(other, cache)
    assert (stack.scales, stack.windows, stack.softcaps) == other.stack_args
    sinks = plan(_model(torch.bfloat16).attention_layers)  # a layer with sinks: no stack arguments
    assert sinks.layer_args[3] is None and sinks.stack_args is None and backend.decode_stack(sinks, cache) is None
    assert plan(plain).stack_args == first.stack_args  # back to the first model's layers
    assert plan((), scale=0.5).stack_args == ((0.5,) * 4, (0,) * 4, (0.0,) * 4)
    assert plan((), scale=0.25).stack_args == ((0.25,) * 4, (0,) * 4, (0.0,) * 4)
    deeper = ContiguousKVCache(CacheSpec(num_layers=6, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                                         device=torch.device("cpu"), max_num_seqs=4, max_seq_len=32))
    assert plan((), scale=0.25, cache=deeper).stack_args == ((0.25,) * 6, (0,) * 6, (0.0,) * 6)
