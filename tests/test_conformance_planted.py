"""The conformance suite can fail: bugs planted in copies of the example backend are each caught, in the
tier expected, with a diagnosis that names the case.

Every planted backend subclasses the example package's ``ChunkedAttentionBackend`` and overrides one of
its seams. The RoPE bug is planted as a backend with a fused-RoPE step: backends receive q/k already
rotated, so a kernel that applies its own rotation with the decode position off by one rotates them
once more, by one position, in decode calls only.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kvcore.conformance.results import FAIL, PASS
from kvcore.conformance.runner import run_case, tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target

try:
    from kvcore_example_backend.backend import ChunkedAttentionBackend
except ImportError:  # the example package is not installed: use it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "kvcore-example-backend" / "src"))
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


#: planted bug -> tiers among (op, cache) that must fail; the others must pass
PLANTED = {
    WrongScale: {"op"},  # consistent between prefill and decode: the cache tier cannot see it
    CausalOffByOne: {"op", "cache"},
    SkipDecodeAppend: {"op", "cache"},
    WrongWritePosition: {"op", "cache"},
    GQAHeadMapping: {"op"},  # same wrong mapping in prefill and decode
    BlockTableOffByOne: {"op", "cache"},
    RopeDecodeOffByOne: {"op", "cache"},
}

CFG = SuiteConfig(quick=True, models=("tiny",))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def first_failure(cls, tier: str, cfg: SuiteConfig = CFG):
    """Run ``tier``'s cases until one fails; the failing CaseResult, or None when all passed."""
    target = resolve_target(cls)
    for case in tier_cases(target, tier, cfg):
        result = run_case(target, tier, case, cfg)
        if result.status == FAIL:
            return result
        assert result.status == PASS, result.describe()
    return None


def test_unplanted_example_passes_op_and_cache_tiers():
    assert first_failure(ChunkedAttentionBackend, "op") is None
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
