"""Stream tier: decode batches whose shape recurs with other per-slot lengths catch state kept by shape."""

from __future__ import annotations

import dataclasses

from kvcore.backends.naive import NaiveBackend
from kvcore.conformance.model_cases import ModelCase
from kvcore.conformance.runner import run_case
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target

CFG = SuiteConfig(quick=True, models=("tiny",), dtype="float32", tiers=("stream",))


class ShapeMemoBackend(NaiveBackend):
    """Keeps each decode shape's (batch size, longest sequence) context lengths from the first time it saw
    it, as a captured plan replayed for the same shape would: right until that shape comes back with other
    per-slot lengths."""

    name = "planted_shape_memo"

    def __init__(self) -> None:
        self.plans: dict[tuple[int, int], list[int]] = {}

    def forward(self, layer_idx, q, k, v, cache, meta):
        if meta.is_decode:
            lens = self.plans.setdefault((meta.num_seqs, meta.max_seq_len), list(meta.context_lens))
            meta = dataclasses.replace(meta, context_lens=lens)
        return super().forward(layer_idx, q, k, v, cache, meta)


def _run(backend, variant):
    case = ModelCase("tiny", variant, 16)
    return run_case(resolve_target(backend), "stream", case, CFG)


def test_recurring_shapes_catch_per_shape_state_that_churn_misses():
    recurring = _run(ShapeMemoBackend, "recurring")
    assert recurring.failed and "diverges from the reference" in recurring.detail, recurring.describe()
    assert _run(ShapeMemoBackend, "churn").passed  # churn's shapes never recur with other lengths


def test_recurring_case_makes_shapes_recur_on_a_correct_backend():
    result = _run("naive", "recurring")
    assert result.passed, result.describe()
    assert result.info["recurring_shapes"] >= 1 and result.info["preemptions"] == 0
