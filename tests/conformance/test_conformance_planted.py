"""The conformance suite can fail: bugs planted in copies of the example backend are each caught, in the
tier expected, with a diagnosis that names the case.

Every planted backend subclasses the example package's ``ChunkedAttentionBackend`` and overrides one of
its seams. The RoPE bug is planted as a backend with a fused-RoPE step: backends receive q/k already
rotated, so a kernel that applies its own rotation with the decode position off by one rotates them
once more, by one position, in decode calls only.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedKVCache
from kvcore.conformance.results import FAIL, PASS, SKIP
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.hookspecs import hookimpl
from kvcore.plugins.registry import PluginRegistry

try:
    from kvcore_example_backend.backend import ChunkedAttentionBackend
except ImportError:  # the example package is not installed: use it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "kvcore-example-backend" / "src"))
    from kvcore_example_backend.backend import ChunkedAttentionBackend


class WrongScale(ChunkedAttentionBackend):
    """Softmax scale 1/d instead of 1/sqrt(d)."""

    name = "planted_wrong_scale"

    def softmax_scale(self, meta, head_dim):
        return 1.0 / head_dim


class CausalOffByOne(ChunkedAttentionBackend):
    """The causal mask lets each query see one key in its future."""

    name = "planted_causal_off_by_one"

    def visible(self, query_pos, key_pos):
        return key_pos[None, :] <= query_pos[:, None] + 1


class SkipDecodeAppend(ChunkedAttentionBackend):
    """Decode steps attend without appending the new token's K/V to the cache."""

    name = "planted_skip_decode_append"

    def write_kv(self, layer_idx, k, v, cache, meta):
        if not meta.is_decode:
            super().write_kv(layer_idx, k, v, cache, meta)


class WrongWritePosition(ChunkedAttentionBackend):
    """Decode steps write the new K/V one slot too far (at seq_len instead of seq_len - 1)."""

    name = "planted_wrong_write_position"

    def write_kv(self, layer_idx, k, v, cache, meta):
        if meta.is_decode:  # one token further in every layout's addressing
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping + 1, positions=meta.positions + 1)
        super().write_kv(layer_idx, k, v, cache, meta)


class GQAHeadMapping(ChunkedAttentionBackend):
    """Query head h reads KV head h % H_kv (interleaved) instead of h // (H / H_kv) (blocked)."""

    name = "planted_gqa_head_mapping"

    def group_queries(self, q, num_kv_heads):
        n, h, d = q.shape
        g = h // num_kv_heads
        return q.transpose(0, 1).reshape(g, num_kv_heads, n, d).transpose(0, 1).reshape(num_kv_heads, g * n, d)

    def ungroup(self, o, num_heads):
        h_kv, rows, d = o.shape
        g = num_heads // h_kv
        n = rows // g
        return o.reshape(h_kv, g, n, d).transpose(0, 1).reshape(num_heads, n, d).transpose(0, 1)


class BlockTableOffByOne(ChunkedAttentionBackend):
    """Paged reads treat block-table entries as 1-based (reads physical block id - 1)."""

    name = "planted_block_table_off_by_one"
    capabilities = dataclasses.replace(ChunkedAttentionBackend.capabilities, kv_layouts=("paged",))

    def physical_blocks(self, table):
        return [b - 1 for b in table]


def _rotate(x: torch.Tensor, delta: int, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = delta * inv_freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RopeDecodeOffByOne(ChunkedAttentionBackend):
    """A fused-RoPE step whose decode position is off by one: q and k are rotated one position further."""

    name = "planted_rope_decode_off_by_one"

    def forward(self, layer_idx, q, k, v, cache, meta):
        if meta.is_decode:
            q, k = _rotate(q, 1), _rotate(k, 1)
        return super().forward(layer_idx, q, k, v, cache, meta)


# -- bugs in the dimensions the matrix varies (head sizes, groups, block sizes, long contexts, mixed
#    calls, forks, reduced precision) -------------------------------------------------------------------
class SplitKVDropsTail(ChunkedAttentionBackend):
    """Above 1,024 keys a split-KV path processes whole 256-key tiles only: the last partial tile is dropped."""

    name = "planted_split_kv_drops_tail"

    def sequence_kv(self, layer_idx, cache, meta, i, seq_len):
        k, v = super().sequence_kv(layer_idx, cache, meta, i, seq_len)
        if seq_len > 1024 and seq_len % 256:
            keep = seq_len - seq_len % 256
            k, v = k[:, :keep], v[:, :keep]
        return k, v


class PaddedHeadDimScale(ChunkedAttentionBackend):
    """Pads head_dim to a multiple of 32 for its kernel and takes the softmax scale from the padded size."""

    name = "planted_padded_head_dim_scale"

    def softmax_scale(self, meta, head_dim):
        padded = -(-head_dim // 32) * 32
        return meta.scale if padded == head_dim else padded**-0.5


class GQAShiftMapping(ChunkedAttentionBackend):
    """Maps query head h to KV head ``h >> int(log2(G))``: right for power-of-two groups only."""

    name = "planted_gqa_shift_mapping"

    def forward(self, layer_idx, q, k, v, cache, meta):
        self._num_heads = q.shape[1]
        return super().forward(layer_idx, q, k, v, cache, meta)

    def sequence_kv(self, layer_idx, cache, meta, i, seq_len):
        k, v = super().sequence_kv(layer_idx, cache, meta, i, seq_len)  # [H_kv, S, D]
        h, h_kv = self._num_heads, k.shape[0]
        kv_of = (torch.arange(h) >> int(math.log2(h // h_kv))).clamp(max=h_kv - 1)
        return k[kv_of], v[kv_of]  # one KV row per query head: group_queries then pairs them 1:1


class AssumesBlockSize16(ChunkedAttentionBackend):
    """Paged reads count blocks as ``ceil(seq_len / 16)`` whatever the cache's block size."""

    name = "planted_assumes_block_size_16"
    capabilities = dataclasses.replace(ChunkedAttentionBackend.capabilities, kv_layouts=("paged",))

    def sequence_kv(self, layer_idx, cache, meta, i, seq_len):
        table = meta.block_tables[i]
        ids = torch.tensor(table[: -(-seq_len // 16)], dtype=torch.long)
        k, v = cache.gather_blocks(layer_idx, ids)
        h_kv, d = k.shape[2], k.shape[3]
        k = k.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)
        v = v.reshape(-1, h_kv, d)[:seq_len].transpose(0, 1)
        if k.shape[1] < seq_len:  # too few blocks read: the rest of the sequence is whatever follows in memory
            pad = torch.zeros((h_kv, seq_len - k.shape[1], d), dtype=k.dtype)
            k, v = torch.cat((k, pad), 1), torch.cat((v, pad), 1)
        return k, v


class MemoisedMaskByQueryLength(ChunkedAttentionBackend):
    """Memoises the causal mask of each key tile by (query length, key range) across calls, forgetting the
    context offset: a chunk of the same length at another offset reuses a mask built for the old one."""

    name = "planted_memoised_mask_by_query_length"

    def __init__(self, **options):
        super().__init__(**options)
        self._masks = {}

    def visible(self, query_pos, key_pos):
        key = (int(query_pos.numel()), int(key_pos[0]), int(key_pos[-1]))
        if key not in self._masks:
            self._masks[key] = super().visible(query_pos, key_pos)
        return self._masks[key]


class MixedCallChunkOffset(ChunkedAttentionBackend):
    """Splits a mixed call into decode rows and prefill chunks, then reads the i-th *chunk*'s context offset
    at index i of the whole call's ``context_lens`` (right only when the chunks come first)."""

    name = "planted_mixed_call_chunk_offset"

    def forward(self, layer_idx, q, k, v, cache, meta):
        chunks = [j for j, n in enumerate(meta.query_lens) if n > 1]
        ctx = list(meta.context_lens)
        for rank, j in enumerate(chunks):
            ctx[j] = meta.context_lens[rank]
        if ctx == list(meta.context_lens):
            return super().forward(layer_idx, q, k, v, cache, meta)
        self.write_kv(layer_idx, k, v, cache, meta)
        out = torch.empty_like(q)
        starts = meta.cu_seqlens_q.tolist()
        scale = self.softmax_scale(meta, q.shape[2])
        for i, (c, n) in enumerate(zip(ctx, meta.query_lens)):
            keys, values = self.sequence_kv(layer_idx, cache, meta, i, meta.context_lens[i] + n)
            qi = q[starts[i] : starts[i + 1]]
            o = self._attend(self.group_queries(qi.float(), keys.shape[0]), keys, values, c, n, scale)
            out[starts[i] : starts[i + 1]] = self.ungroup(o, q.shape[1]).to(q.dtype)
        return out


class ReducedPrecisionAccumulation(ChunkedAttentionBackend):
    """In bfloat16 / float16, keeps the running softmax sum and output in the model dtype, adding one key
    at a time (float32 is unaffected: the same code then accumulates in float32)."""

    name = "planted_reduced_precision_accumulation"

    def forward(self, layer_idx, q, k, v, cache, meta):
        self._dtype = q.dtype
        return super().forward(layer_idx, q, k, v, cache, meta)

    def _attend(self, qg, keys, values, ctx, n, scale, layer=None):
        dt = self._dtype
        if dt == torch.float32 or (layer is not None and layer.variants):  # plain layers carry the bug
            return super()._attend(qg, keys, values, ctx, n, scale, layer)
        group = qg.shape[1] // n
        query_pos = (ctx + torch.arange(n)).repeat(group)
        s = (qg @ keys.float().transpose(1, 2)) * scale  # [H_kv, rows, S]
        s = s.masked_fill(~self.visible(query_pos, torch.arange(keys.shape[1])), -math.inf)
        p = torch.exp(s - s.amax(dim=-1, keepdim=True)).to(dt)
        l = torch.zeros(p.shape[:2], dtype=dt)
        acc = torch.zeros((*p.shape[:2], values.shape[2]), dtype=dt)
        vals = values.to(dt)
        for j in range(min(keys.shape[1], ctx + n)):  # the bug: one rounding to the model dtype per key
            l = l + p[..., j]
            acc = acc + p[..., j, None] * vals[:, j, None, :]
        return acc.float() / l.float()[..., None]


class NoCopyOnWriteCache(PagedKVCache):
    """A paged cache whose ``copy_blocks`` does nothing: a forked sequence keeps sharing the partial block,
    so the first append on one side is seen by (and lost to) the other."""

    name = "planted_no_copy_on_write"

    def copy_blocks(self, pairs):
        pass


class NoClearCache(ContiguousKVCache):
    """A contiguous cache that leaves what a freed slot holds for the next sequence there: a reader that pads a
    batch to its longest sequence reads those rows at weight 0, and ``0 × NaN`` is NaN."""

    name = "planted_no_clear"

    def before_forward(self, meta):
        pass


class ReadsWholeBlocks(ChunkedAttentionBackend):
    """Reads every row of a sequence's last block and masks the rows past its length by weight (``p = 0``), so a
    row an earlier request left there enters ``p · v`` as ``0 × NaN``."""

    name = "planted_reads_whole_blocks"

    def sequence_kv(self, layer_idx, cache, meta, i, seq_len):
        whole = -(-seq_len // cache.block_size) * cache.block_size if cache.layout == "paged" else seq_len
        return super().sequence_kv(layer_idx, cache, meta, i, whole)


#: planted bug -> tiers among (op, cache) that must fail; the others must pass
PLANTED = {
    WrongScale: {"op"},  # consistent between prefill and decode: the cache tier cannot see it
    CausalOffByOne: {"op", "cache"},
    SkipDecodeAppend: {"op", "cache"},
    WrongWritePosition: {"op", "cache"},
    GQAHeadMapping: {"op"},  # same wrong mapping in prefill and decode
    BlockTableOffByOne: {"op", "cache"},
    RopeDecodeOffByOne: {"op", "cache"},
    # new dimensions: the tiny model (head_dim 32, group 2, contexts < 1,024, block size 16, no mixed calls)
    # cannot show these; the op matrix must
    SplitKVDropsTail: {"op"},
    PaddedHeadDimScale: {"op"},
    GQAShiftMapping: {"op"},
    AssumesBlockSize16: {"op"},
    MemoisedMaskByQueryLength: {"op"},  # the model tiers never repeat a chunk length at another offset
    MixedCallChunkOffset: {"op"},  # the engine never mixes prefill chunks and decode rows in one call
    ReducedPrecisionAccumulation: {"op"},  # bfloat16 / float16 cases over 2,000+ keys
}

CFG = SuiteConfig(quick=True, models=("tiny",))


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _order(cases: list) -> list:
    """Reduced-precision cases first: they are the fewest and span every dimension, so most bugs show
    within a few cases (the assertion is only that *some* --quick case fails)."""
    return sorted(cases, key=lambda c: c.dtype is None or c.dtype == torch.float32)


def first_failure(cls, tier: str, cfg: SuiteConfig = CFG):
    """Run ``tier``'s cases until one fails; the failing CaseResult, or None when all passed (or were skipped:
    the planted backends declare no compilable decode path, so the stream tier's ``compiled`` cases skip)."""
    target = resolve_target(cls)
    for case in _order(tier_cases(target, tier, cfg)):
        result = run_case(target, tier, case, cfg)
        if result.status == FAIL:
            return result
        assert result.status == PASS or (result.status == SKIP and _declared_skip(result)), result.describe()
    return None


def _declared_skip(result) -> bool:
    """A skip the contract allows: the stream tier's ``compiled`` cases for a backend with no compilable decode
    path, an attention variant the backend does not declare (the reason names it: "no attention sinks")."""
    return "compiled" in result.case or "no " in result.describe()


def test_unplanted_example_passes_op_and_cache_tiers():
    # float32 over the paged cache here (every case of the quick matrix); both caches and the reduced
    # precisions are certified by the example package's own conformance tests and the documented CLI runs
    fp32 = dataclasses.replace(CFG, dtype="float32")
    assert _first_failure_of(resolve_target(ChunkedAttentionBackend, kv_cache="paged"), "op", fp32) is None
    assert first_failure(ChunkedAttentionBackend, "cache") is None


@pytest.mark.parametrize("cls", list(PLANTED), ids=lambda c: c.name.removeprefix("planted_"))
def test_planted_bug_is_caught_in_expected_tiers(cls):
    failing = {}
    for tier in ("op", "cache"):
        result = first_failure(cls, tier)
        if result is not None:
            failing[tier] = result
    assert set(failing) == PLANTED[cls], {t: r.describe() for t, r in failing.items()}
    op = failing["op"]
    assert op.case in op.describe() and "[op]" in op.describe()
    # the diagnosis names the call, the shapes and the size of the error
    assert "H=" in op.detail or "cached" in op.detail or "raised" in op.detail
    assert op.max_err is None or op.max_err > 1e-3


def test_gqa_bug_shows_only_on_grouped_layouts():
    target = resolve_target(GQAHeadMapping)
    results = {c.id: run_case(target, "op", c, CFG) for c in tier_cases(target, "op", CFG) if "ragged" in c.id}
    results = {i: r for i, r in results.items() if not (r.status == SKIP and _declared_skip(r))}
    assert any(i.startswith("gqa") for i in results) and not all(i.startswith("gqa") for i in results)
    for case_id, r in results.items():
        grouped = case_id.startswith("gqa")  # MHA (group 1) and MQA (one KV head) map heads identically
        assert r.status == (FAIL if grouped else PASS), r.describe()


def test_stream_tier_names_first_divergent_step_with_both_tokens_and_margins():
    result = first_failure(WrongScale, "stream")
    assert result is not None
    assert "diverges from the reference at step" in result.detail
    info = result.info
    assert {"step", "ref_token", "got_token", "ref_margin", "got_margin", "ref_top", "got_top"} <= set(info)
    assert info["ref_token"] != info["got_token"]
    assert f"reference token {info['ref_token']}" in result.detail
    assert f"backend token {info['got_token']}" in result.detail


def test_failure_detail_for_write_position_points_at_the_cache():
    result = first_failure(WrongWritePosition, "op")
    assert "decode" in result.detail
    assert result.info["call"] >= 1  # prefill (call 0) is fine; the first decode call breaks


def _first_failure_of(target, tier: str, cfg: SuiteConfig = CFG):
    for case in _order(tier_cases(target, tier, cfg)):
        result = run_case(target, tier, case, cfg)
        if result.status == FAIL:
            return result
        # a variant the backend does not declare is skipped with the reason, never failed
        assert result.status == PASS or (result.status == SKIP and _declared_skip(result)), result.describe()
    return None


def test_fork_without_copy_on_write_is_caught_by_the_fork_scenario():
    """Certifying a KV cache (``--kv-cache``): the fork scenario's both-sides append needs copy-on-write."""

    class Plugin:
        @hookimpl
        def kvcore_register_kv_caches(self, register):
            register(NoCopyOnWriteCache)

    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(Plugin(), name="planted-no-cow")
    target = resolve_target("paged", registry, kv_cache="planted_no_copy_on_write")
    op = _first_failure_of(target, "op")
    assert op is not None and "-fork" in op.case, op
    assert "fork" in op.case and ("cached" in op.detail or "diverges" in op.detail)
    cache = _first_failure_of(target, "cache")  # the cache driven directly forks too
    assert cache is not None and cache.case.startswith("store"), cache
    assert "fork" in cache.detail


def _poisoned(target, cfg: SuiteConfig = CFG):
    (case,) = [c for c in tier_cases(target, "cache", cfg) if c.id == "poisoned"]
    return run_case(target, "cache", case, cfg)


def test_rows_a_freed_request_left_are_caught_in_a_cache_that_keeps_them_and_a_backend_that_reads_them():
    """The poisoned case (NaN and huge K/V left in every freed slot) passes for the built-in caches and the example
    backend over both its layouts, and fails a cache that does not clear freed slots (read by sdpa, which pads a
    batch) and a backend that reads a paged sequence's whole last block, naming stale K/V, the cache and the step."""
    for backend, cache in (("sdpa", None), ("paged", None), ("paged", "int8")):
        result = _poisoned(resolve_target(backend, kv_cache=cache))
        assert result.status == PASS, result.describe()
    example = _poisoned(resolve_target(ChunkedAttentionBackend))
    assert example.status == PASS and "KV cache contiguous, paged" in example.detail, example.describe()

    class Plugin:
        @hookimpl
        def kvcore_register_kv_caches(self, register):
            register(NoClearCache)

    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(Plugin(), name="planted-no-clear")
    no_clear = _poisoned(resolve_target("sdpa", registry, kv_cache="planted_no_clear"))
    assert no_clear.status == FAIL and no_clear.detail.startswith("stale K/V"), no_clear.describe()
    assert "decode step" in no_clear.detail and "the short sequence" in no_clear.detail, no_clear.detail

    assert _poisoned(resolve_target(ReadsWholeBlocks, kv_cache="contiguous")).status == PASS  # that cache clears
    whole = _poisoned(resolve_target(ReadsWholeBlocks))
    assert whole.status == FAIL and "stale K/V" in whole.detail and "KV cache 'paged'" in whole.detail, whole


def test_new_dimension_bugs_are_missed_by_the_tiny_model_tiers():
    """Why the op matrix must vary every dimension: the model-level tiers run the tiny model (head_dim 32,
    group 2, block size 16, short contexts) and see none of these."""
    for cls in (SplitKVDropsTail, PaddedHeadDimScale, GQAShiftMapping):
        assert first_failure(cls, "stream", dataclasses.replace(CFG, dtype="float32")) is None, cls.name


def test_mixed_call_offset_bug_shows_in_the_churn_stream():
    """With chunked prefill the engine itself mixes prefill chunks and decode rows in one call: the churn
    stream (requests joining while others decode) exposes a wrong per-sequence offset too."""
    result = first_failure(MixedCallChunkOffset, "stream", dataclasses.replace(CFG, dtype="float32"))
    assert result is not None and result.case == "tiny-churn", result


def test_block_size_assumption_shows_in_the_churn_stream():
    """The engine's block size is 16 except in the churn case (8): only there does the stream tier see it."""
    result = first_failure(AssumesBlockSize16, "stream", dataclasses.replace(CFG, dtype="float32"))
    assert result is not None and result.case == "tiny-churn", result
    assert "diverges from the reference" in result.detail
