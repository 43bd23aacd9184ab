"""Shared plumbing of the model-level tiers: case ids, which models a tier uses, capability skips."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.conformance.cases import dtype_suffix
from kvcore.conformance.models import get_model
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.errors import KVCoreError
from kvcore.interfaces.layer_attention import variants_of

__all__ = ["ModelCase", "tier_models", "skip_reasons", "dtype_plan"]


@dataclass(frozen=True)
class ModelCase:
    model: str  # model spec: "tiny", "smollm2", a path
    variant: str
    steps: int  # decode steps / new tokens
    dtype: torch.dtype | None = None  # None: the run's dtype
    reader: str | None = None  # a backend other than the one under test that reads the cache under test

    @property
    def id(self) -> str:
        via = f"-via-{self.reader}" if self.reader else ""
        return f"{_short(self.model)}-{self.variant}{via}{dtype_suffix(self.dtype)}"


def _short(spec: str) -> str:
    if spec in ("tiny", "tiny-local", "smollm2"):
        return spec
    return spec.rstrip("/").replace("\\", "/").split("/")[-1]


def tier_models(cfg: SuiteConfig, first_only_when_quick: bool) -> tuple[str, ...]:
    return cfg.models[:1] if (cfg.quick and first_only_when_quick) else cfg.models


def dtype_plan(cfg: SuiteConfig) -> list[tuple[torch.dtype | None, bool]]:
    """``(case dtype tag, is reduced)`` for each dtype of the run: float32 (or the one dtype given) runs a
    tier's whole case list, each further reduced precision a smaller one (the first model only)."""
    if len(cfg.dtypes) == 1:
        return [(None, cfg.dtype != torch.float32)]
    return [(d, d != torch.float32) for d in cfg.dtypes]


def skip_reasons(target: Target, case: ModelCase, cfg: SuiteConfig) -> list[str]:
    """Reasons the case cannot run (capability not declared). A model that cannot be loaded is not a
    skip: it raises, and the case fails with the reason (exclude the model with ``--model``)."""
    try:
        cm = get_model(case.model, cfg.dtype, cfg.device)
    except KVCoreError as exc:
        raise KVCoreError(f"model '{case.model}' cannot be loaded: {exc} (leave it out with --model)") from None
    caps = target.capabilities
    reasons = caps.reasons_unsupported(device=cfg.torch_device, dtype=cfg.dtype, **cm.shape_kwargs())
    if not caps.supports_prefill:
        reasons.append("backend declares no prefill support")
    if not caps.supports_decode:
        reasons.append("backend declares no decode support")
    reasons += caps.reasons_variants(variants_of(cm.model.attention_layers) | set(cfg.attention_variants))
    names = target.cache_names()
    if names:
        cache_caps = target.cache_class(names[0]).capabilities
        reasons += [f"KV cache '{names[0]}': {r}" for r in
                    cache_caps.reasons_unsupported(device=cfg.torch_device, dtype=cfg.dtype)]
    return reasons
