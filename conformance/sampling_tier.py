"""Sampling tier: the sampler against kvcore's reference (the ``oracle-*`` cases, see
:mod:`kvcore.conformance.sampler_oracle`), and seeded sampling through the engine is reproducible and
(float32) identical across backends.

``repeat``: the backend under test runs the same two seeded requests (a ragged batch) twice; the
streams must be identical. ``vs-reference`` (float32 only): the same seeded requests on ``naive`` give
the same streams. Sampling: temperature 0.8, top-k 50, top-p 0.95.
"""

from __future__ import annotations

from kvcore.conformance.driver import run_engine
from kvcore.conformance.model_cases import ModelCase, dtype_plan, tier_models
from kvcore.conformance.model_cases import skip_reasons as model_skip_reasons
from kvcore.conformance.models import get_model
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.sampler_oracle import check_oracle
from kvcore.conformance.sampler_scenarios import FAMILY_ALPHA, OracleCase, oracle_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.stream_tier import compare_streams, reference_streams
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import TieRule
from kvcore.interfaces.sampler import SamplingParams

__all__ = ["NAME", "cases", "tolerance", "skip_reasons", "check"]

NAME = "sampling"
TITLE = "Sampling: draws vs kvcore's reference; seeded streams reproducible and equal across backends"
VARIANTS = ("repeat", "vs-reference")
SEEDS = (11, 22)
_EXACT = TieRule(exact=True)


def _new_tokens(model: str, quick: bool) -> int:
    if model == "tiny":
        return 12 if quick else 24
    return 6 if quick else 12


def cases(target: Target, cfg: SuiteConfig) -> list[OracleCase | ModelCase]:
    out: list[OracleCase | ModelCase] = oracle_cases()
    for dtype, reduced in dtype_plan(cfg):
        models = cfg.models[:1] if reduced else tier_models(cfg, first_only_when_quick=True)
        variants = ("repeat",) if reduced else VARIANTS  # across backends: float32 only
        out += [ModelCase(m, v, _new_tokens(m, cfg.quick), dtype) for m in models for v in variants]
    return out


def sampled_params(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=n, temperature=0.8, top_k=50, top_p=0.95, seed=s, ignore_eos=True) for s in SEEDS
    ]


def tolerance(target: Target, case: OracleCase | ModelCase, cfg: SuiteConfig) -> str:
    if isinstance(case, OracleCase) and case.kind == "draws":
        return f"reference support exact, chi-square at family alpha {FAMILY_ALPHA:g}"
    return "exact"


def skip_reasons(target: Target, case: OracleCase | ModelCase, cfg: SuiteConfig) -> list[str]:
    if isinstance(case, OracleCase):
        return []
    reasons = model_skip_reasons(target, case, cfg)
    if case.variant == "vs-reference" and cfg.dtype_name != "float32":
        reasons.append(f"sampled streams are compared across backends in float32 only (got {cfg.dtype_name})")
    if case.variant == "vs-reference" and target.unit_roundoff:
        reasons.append("sampled streams over a lossy KV cache are not compared with the lossless reference "
                       "(the stream tier compares its greedy streams tie-aware)")
    return reasons


def check(target: Target, case: OracleCase | ModelCase, cfg: SuiteConfig, result: CaseResult) -> None:
    if isinstance(case, OracleCase):
        check_oracle(target, case, cfg, result)
        return
    cm = get_model(case.model, cfg.dtype, cfg.device)
    prompts = list(cm.prompts[:2])
    params = sampled_params(case.steps)
    result.info.update(model=case.model, seeds=list(SEEDS), new_tokens=case.steps)
    result.info["where"] = f"model {case.model}: generation"
    first = run_engine(target, cm, prompts, params, cfg)
    if case.variant == "repeat":
        other, what = run_engine(target, cm, prompts, params, cfg), "a second run with the same seeds"
    else:
        other = reference_streams(cm, ("sampled", case.steps), prompts, params, cfg, target)
        what = "the reference backend with the same seeds"
    for i, (a, b) in enumerate(zip(other, first)):
        c = compare_streams(a, b, _EXACT)
        if c["equal"]:
            continue
        result.status = FAIL
        if "ref_token" not in c:
            result.detail = f"model {case.model}, seed {SEEDS[i]}: {c['why']}"
            return
        result.detail = (
            f"model {case.model}, seed {SEEDS[i]}: the sampled stream differs from {what} at step {c['step']}: "
            f"expected token {c['ref_token']}, got {c['got_token']} (logit gap {c['ref_margin']:.4g} vs "
            f"{c['got_margin']:.4g}); expected {a.tokens[: c['step'] + 1]}, got {b.tokens[: c['step'] + 1]}"
        )
        result.info.update(seed=SEEDS[i], **{k: v for k, v in c.items() if k != "equal"})
        return
    result.detail = f"model {case.model}: {len(SEEDS)} seeded streams of {case.steps} tokens identical to {what}"
