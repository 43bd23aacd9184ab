"""What a run covers, tier by tier: the values of every dimension its cases vary, for the report header."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.conformance.cache_poison import PoisonCase
from kvcore.conformance.cases import OpCase
from kvcore.conformance.sampler_scenarios import OracleCase
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.speculative_tier import DTYPE as SPECULATIVE_DTYPE
from kvcore.conformance.speculative_tier import MODEL as SPECULATIVE_MODEL
from kvcore.conformance.speculative_tier import VARIANTS_MODEL as SPECULATIVE_VARIANTS_MODEL
from kvcore.conformance.speculative_tier import SpecCase
from kvcore.interfaces.dtypes import dtype_name

__all__ = ["tier_coverage", "coverage_line", "case_dimensions"]


def _dtype_names(cases: Sequence, cfg: SuiteConfig) -> list[str]:
    dtypes = {c.dtype or cfg.dtype for c in cases}
    return [dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16) if d in dtypes]


def case_dimensions(case, cfg: SuiteConfig) -> dict[str, str]:
    """The dimensions one case takes a value in (what a report groups failures by)."""
    dtype = dtype_name(getattr(case, "dtype", None) or cfg.dtype)
    if isinstance(case, OpCase):
        return {"dtype": dtype, "kv_cache": case.kv_cache or "", "heads": f"{case.num_heads}/{case.num_kv_heads}",
                "head_dim": str(case.head_dim), "block_size": str(case.block_size), "scenario": case.scenario,
                "attention": getattr(case, "pattern", None) or "causal"}
    if isinstance(case, SpecCase):
        return {"kind": "speculative", "dtype": SPECULATIVE_DTYPE, "proposer": case.proposer,
                "variant": case.variant}
    if isinstance(case, OracleCase):
        return {"kind": "sampler oracle", "scenario": case.id.removeprefix("oracle-")}
    if isinstance(case, PoisonCase):
        return {"kind": "stale K/V", "dtype": dtype, "model": case.model}
    if hasattr(case, "model"):
        return {"kind": "model", "dtype": dtype, "model": case.model, "variant": case.variant,
                "reader": case.reader or "the backend"}
    return {"kind": "cache driven directly", "dtype": dtype}


def tier_coverage(tier: str, cases: Sequence, cfg: SuiteConfig, kv_caches: Sequence[str] = ()) -> dict:
    """Machine-readable coverage of ``cases`` (one tier's case list)."""
    if not cases:
        return {"cases": 0}
    if isinstance(cases[0], OpCase):
        return {
            "cases": len(cases),
            "dtypes": _dtype_names(cases, cfg),
            "kv_caches": sorted({c.kv_cache for c in cases if c.kv_cache}) or list(kv_caches[:1]),
            "heads": [f"{h}/{hkv}" for h, hkv in sorted({(c.num_heads, c.num_kv_heads) for c in cases})],
            "gqa_groups": sorted({c.num_heads // c.num_kv_heads for c in cases}),
            "mqa": any(c.num_kv_heads == 1 for c in cases),
            "head_dims": sorted({c.head_dim for c in cases}),
            "block_sizes": sorted({c.block_size for c in cases}),
            "scenarios": sorted({c.scenario for c in cases}),
            "max_keys": max(max(c.final_lens) for c in cases),
        }
    if isinstance(cases[0], SpecCase):  # float32 streams of one model, with and without each proposer
        models = {SPECULATIVE_VARIANTS_MODEL if c.variant == "variants" else SPECULATIVE_MODEL for c in cases}
        return {"cases": len(cases), "dtypes": ["float32"], "models": sorted(models),
                "proposers": sorted({c.proposer for c in cases}), "variants": sorted({c.variant for c in cases})}
    oracle = [c.id.removeprefix("oracle-") for c in cases if isinstance(c, OracleCase)]
    models = [c for c in cases if hasattr(c, "model") and not isinstance(c, PoisonCase)]
    cov = {
        "cases": len(cases),
        "dtypes": _dtype_names(models, cfg),
        "models": sorted({c.model for c in models}),
        "variants": sorted({c.variant for c in models}),
    }
    if oracle:
        cov["sampler_oracle"] = oracle
    readers = sorted({c.reader for c in models if c.reader})
    if readers:
        cov["readers"] = readers
    if any(c.id.startswith("store") for c in cases):
        cov["store"] = list(kv_caches)
    if any(isinstance(c, PoisonCase) for c in cases):
        cov["poisoned"] = list(kv_caches)
    return cov


def coverage_line(tier: str, cov: dict) -> str:
    """One human line: ``op: 98 cases; float32, bfloat16; heads 8/8, ...``."""
    if not cov.get("cases"):
        return f"{tier}: no cases"
    parts = [f"{cov['cases']} cases", ", ".join(cov["dtypes"])]
    if "head_dims" in cov:
        caches = f"; KV cache {', '.join(cov['kv_caches'])}" if cov["kv_caches"] else ""
        parts[-1] += caches
        parts += [
            f"heads (H/H_kv) {' '.join(cov['heads'])} (GQA groups {', '.join(map(str, cov['gqa_groups']))}"
            f"{', MQA' if cov['mqa'] else ''})",
            f"head_dim {', '.join(map(str, cov['head_dims']))}",
            f"block_size {', '.join(map(str, cov['block_sizes']))} (paged caches)",
            f"scenarios {', '.join(cov['scenarios'])}",
            f"up to {cov['max_keys']} keys",
        ]
    else:
        parts += [f"models {', '.join(cov['models'])}", f"variants {', '.join(cov['variants'])}"]
        if cov.get("proposers"):
            parts.append(f"proposers {', '.join(cov['proposers'])}")
        if cov.get("store"):
            parts.append(f"driven directly: {', '.join(cov['store'])}")
        if cov.get("poisoned"):
            parts.append(f"freed slots poisoned: {', '.join(cov['poisoned'])}")
        if cov.get("readers"):
            parts.append(f"also read through {', '.join(cov['readers'])}")
        if cov.get("sampler_oracle"):
            parts.append(f"sampler oracle {', '.join(cov['sampler_oracle'])}")
    return f"{tier}: " + "; ".join(parts)
