"""Caches certified through every reader and driven directly: planted caches whose write() drops a row or whose
int8 scales are off."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import make_plugin, registered

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.quantized import Int8KVCache
from kvcore.cli import main
from kvcore.conformance.cache_store import StoreCase, check_store
from kvcore.conformance.results import FAIL, PASS, CaseResult
from kvcore.conformance.runner import tier_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.plugins.registry import get_registry


class DropsLastRowCache(ContiguousKVCache):
    """write() stores every row of a call but its last."""

    name = "planted_drops_last_row"

    def write(self, layer_idx, k, v, meta):
        keep = meta.slot_mapping.numel() - 1
        rows = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:keep], positions=meta.positions[:keep])
        super().write(layer_idx, k[:keep], v[:keep], rows)


class ScaleOffCache(Int8KVCache):
    """The int8 cache with its scales stored 5% too large: large elements off by a few times their rounding."""

    name = "planted_int8_scale_off"

    @staticmethod
    def quantize(x):
        q, scale = Int8KVCache.quantize(x)
        return q, scale * 1.05


@pytest.fixture
def planted_cache():
    with registered(get_registry(), make_plugin(kv_caches=[DropsLastRowCache]), "planted-cache"):
        yield DropsLastRowCache.name


@pytest.fixture
def scale_off_cache():
    with registered(get_registry(), make_plugin(kv_caches=[ScaleOffCache]), "planted-scale-off"):
        yield ScaleOffCache.name


def _store(cache: str) -> CaseResult:
    result = CaseResult(tier="cache", case="store", status=PASS)
    check_store(resolve_target(None, kv_cache=cache), StoreCase(), SuiteConfig(quick=True, dtype="float32"), result)
    return result


def test_int8_cache_keeps_what_was_written_within_its_rounding():
    """Its rounding is up to 1/254 of each row's largest magnitude, not of each element: the store case
    measures it per row (a per-element bound failed rows with small elements beside large ones)."""
    result = _store("int8")
    assert result.status == PASS, result.detail


def test_int8_scales_five_percent_off_are_caught(scale_off_cache):
    result = _store(scale_off_cache)
    assert result.status == FAIL
    assert "differs from what was written" in result.detail


def test_cache_dropping_a_row_in_write_is_caught(planted_cache, capsys):
    rc = main(["conformance", "--kv-cache", planted_cache, "--quick", "--model", "tiny", "--dtype", "float32",
               "--tier", "cache", "--no-progress", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    failed = {r["case"]: r["detail"] for r in report["results"] if r["status"] == "fail"}
    assert "store" in failed
    assert "differs from what was written" in failed["store"]
    assert any("-via-naive" in case for case in failed), failed  # read through naive, which calls write()


def test_cache_runs_through_every_builtin_reader_of_its_layout():
    target = resolve_target(None, kv_cache="contiguous")
    readers = target.other_readers()
    assert readers[0] == "naive" and target.name not in readers
    ids = [c.id for c in tier_cases(target, "cache", SuiteConfig(quick=True, models=("tiny",), dtype="float32"))]
    assert "store" in ids
    assert {f"tiny-single-via-{r}" for r in readers} <= set(ids)
