"""Shared plumbing of the model-level tiers: case ids, which models a tier uses, capability skips."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.conformance.models import get_model
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.errors import KVCoreError

__all__ = ["ModelCase", "tier_models", "skip_reasons"]


@dataclass(frozen=True)
class ModelCase:
    model: str  # model spec: "tiny", "smollm2", a path
    variant: str
    steps: int  # decode steps / new tokens

    @property
    def id(self) -> str:
        return f"{_short(self.model)}-{self.variant}"


def _short(spec: str) -> str:
    if spec in ("tiny", "smollm2"):
        return spec
    return spec.rstrip("/").replace("\\", "/").split("/")[-1]


def tier_models(cfg: SuiteConfig, first_only_when_quick: bool) -> tuple[str, ...]:
    return cfg.models[:1] if (cfg.quick and first_only_when_quick) else cfg.models


def skip_reasons(target: Target, case: ModelCase, cfg: SuiteConfig) -> list[str]:
    """Reasons the case cannot run (model missing, capability not declared)."""
    try:
        cm = get_model(case.model, cfg.dtype, cfg.device)
    except KVCoreError as exc:
        return [f"model '{case.model}' unavailable: {exc}"]
    caps = target.capabilities
    reasons = caps.reasons_unsupported(device=cfg.torch_device, dtype=cfg.dtype, **cm.shape_kwargs())
    if not caps.supports_prefill:
        reasons.append("backend declares no prefill support")
    if not caps.supports_decode:
        reasons.append("backend declares no decode support")
    return reasons
