"""Cache tier: prefill + cached decode gives the logits full recomputation gives, at every step.

For each step, the logits the backend computes from its KV cache (one decode row per sequence) are
compared with the logits of a *fresh* cache and one prefill of the whole sequence so far, same backend.
Tokens are teacher-forced (a fixed continuation), so one divergence does not cascade. Variants:
``single`` (one sequence), ``ragged`` (all prompts batched, ragged lengths), ``chunked`` (each prompt
prefilled in two chunks, the second continuing the cache, then batched decode).

Certifying a KV cache (``--kv-cache``), the variants also run through every other available built-in backend
that reads the cache's layout (``naive`` included; case ids ``...-via-NAME``), since a backend may write
through its own path and never call the cache's ``write``; and ``store-NAME`` drives the cache directly
against a reference store (:mod:`kvcore.conformance.cache_store`); the readers are not known when pytest
collects, so the pytest plugin runs ``store`` but not the ``-via-`` cases. ``poisoned``
(:mod:`kvcore.conformance.cache_poison`) fills each cache with NaN and huge K/V from requests that are then freed,
and checks that later requests reusing the slots decode as on a fresh cache.
"""

from __future__ import annotations

import torch

from kvcore.conformance.cache_poison import PoisonCase, check_poisoned
from kvcore.conformance.cache_store import StoreCase, check_store, store_tolerance
from kvcore.conformance.compare import compare
from kvcore.conformance.driver import cache_spec, forward_logits
from kvcore.conformance.model_cases import ModelCase, dtype_plan, tier_models
from kvcore.conformance.model_cases import skip_reasons as model_skip_reasons
from kvcore.conformance.models import get_model
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import cache_tolerance, tie_rule
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = ["NAME", "cases", "tolerance", "skip_reasons", "check"]

NAME = "cache"
TITLE = "Cache consistency: cached decode vs full recomputation"
VARIANTS = ("single", "ragged", "chunked")


def _steps(model: str, quick: bool) -> int:
    if model == "tiny":
        return 8 if quick else 16
    return 3 if quick else 4


def cases(target: Target, cfg: SuiteConfig) -> list[ModelCase | StoreCase | PoisonCase]:
    out: list[ModelCase | StoreCase | PoisonCase] = []
    readers = target.other_readers() if target.kv_cache else ()
    for dtype, reduced in dtype_plan(cfg):
        out.append(StoreCase(dtype))
        if not reduced:
            out.append(PoisonCase(cfg.models[0], dtype))
        models = cfg.models[:1] if reduced else tier_models(cfg, first_only_when_quick=True)
        for model in models:
            for variant in VARIANTS:
                out.append(ModelCase(model, variant, _steps(model, cfg.quick), dtype))
                if model == models[0] and not reduced:
                    out += [ModelCase(model, variant, _steps(model, cfg.quick), dtype, r) for r in readers]
    return out


def tolerance(target: Target, case: ModelCase | StoreCase | PoisonCase, cfg: SuiteConfig) -> str:
    if isinstance(case, StoreCase):
        return str(store_tolerance(target))
    return str(cache_tolerance(cfg.dtype, target.unit_roundoff))


def skip_reasons(target: Target, case: ModelCase | StoreCase | PoisonCase, cfg: SuiteConfig) -> list[str]:
    if isinstance(case, StoreCase):
        return [f"KV cache '{name}': {r}" for name in target.cache_names() for r in
                target.cache_class(name).capabilities.reasons_unsupported(device=cfg.torch_device, dtype=cfg.dtype)]
    if isinstance(case, PoisonCase):
        return model_skip_reasons(target, ModelCase(case.model, "ragged", 0, case.dtype), cfg) + [
            f"KV cache '{name}': {r}" for name in target.cache_names() for r in
            target.cache_class(name).capabilities.reasons_unsupported(device=cfg.torch_device, dtype=cfg.dtype)]
    return model_skip_reasons(target.via(case.reader) if case.reader else target, case, cfg)


def check(target: Target, case: ModelCase | StoreCase | PoisonCase, cfg: SuiteConfig, result: CaseResult) -> None:
    if isinstance(case, StoreCase):
        check_store(target, case, cfg, result)
        return
    if isinstance(case, PoisonCase):
        check_poisoned(target, case, cfg, result)
        return
    if case.reader:
        result.info["reader"] = case.reader
        target = target.via(case.reader)
    _run(target, get_model(case.model, cfg.dtype, cfg.device), case, cfg, result)


def _run(target: Target, cm, case: ModelCase, cfg: SuiteConfig, result: CaseResult) -> None:
    tol, rule = cache_tolerance(cfg.dtype, target.unit_roundoff), tie_rule(cfg.dtype, target.unit_roundoff)
    prompts = [cm.prompts[1]] if case.variant == "single" else list(cm.prompts)
    conts = [cm.continuation(case.steps, salt=str(i)) for i in range(len(prompts))]
    seqs = [p + c for p, c in zip(prompts, conts)]
    B = len(seqs)
    max_len = max(len(s) for s in seqs) + 16
    backend = target.make()
    result.info.update(model=case.model, variant=case.variant, prompt_lens=[len(p) for p in prompts],
                       steps=case.steps)

    name = target.cache_names()[0]
    cache = KVCacheManager(target.make_cache(name, cache_spec(cm, cfg, B, max_len)))
    result.info["kv_cache"] = name
    ids = list(range(B))
    for i in ids:
        cache.add_sequence(i)
    cached: list[torch.Tensor] = []  # per step: [B, V]
    if case.variant == "chunked":
        result.info["where"] = "cached path: first prefill chunk"
        firsts = [max(1, len(p) // 2) for p in prompts]
        forward_logits(cm, backend, cache, ids, [p[:f] for p, f in zip(prompts, firsts)])
        result.info["where"] = "cached path: second prefill chunk (continuing the cache)"
        cached.append(forward_logits(cm, backend, cache, ids, [p[f:] for p, f in zip(prompts, firsts)]))
    else:
        result.info["where"] = "cached path: prefill"
        cached.append(forward_logits(cm, backend, cache, ids, prompts))
    for step in range(1, case.steps + 1):
        result.info["where"] = f"cached path: decode step {step}"
        tokens = [[s[len(p) + step - 1]] for s, p in zip(seqs, prompts)]
        cached.append(forward_logits(cm, backend, cache, ids, tokens))

    worst = 0.0
    for step in range(case.steps + 1):
        result.info["where"] = f"recomputation of step {step}"
        fresh = KVCacheManager(target.make_cache(name, cache_spec(cm, cfg, B, max_len)))
        for i in ids:
            fresh.add_sequence(i)
        full = forward_logits(cm, backend, fresh, ids, [s[: len(p) + step] for s, p in zip(seqs, prompts)])
        for b in ids:
            m = compare(cached[step][b], full[b], tol)
            worst = max(worst, m.max_err)
            top_c, top_f = int(cached[step][b].argmax()), int(full[b].argmax())
            top2 = full[b].topk(2).values
            gap = float(top2[0] - top2[1])
            top1_bad = not rule.exact and top_c != top_f and gap > rule.max_gap
            if m.ok and not top1_bad:
                continue
            pos = len(prompts[b]) + step - 1
            phase = "prefill" if step == 0 else f"decode step {step}"
            if case.variant == "chunked" and step == 0:
                phase = "prefill continuing the cache (2nd chunk)"
            result.status = FAIL
            result.max_err = m.max_err
            result.detail = (
                f"model {case.model}, {case.variant}: at {phase} (position {pos}) of seq {b} "
                f"(prompt {len(prompts[b])} tokens) the logits from the KV cache differ from full recomputation: "
                f"max |err| {m.max_err:.3g} ({tol}), {m.num_bad}/{m.numel} logits off; top-1 token cached "
                f"{top_c} vs recomputed {top_f} (recomputed top-2 gap {gap:.3g})"
            )
            result.info.update(step=step, seq=b, position=pos, top1_cached=top_c, top1_recomputed=top_f)
            return
    result.max_err = worst
    result.detail = (
        f"model {case.model}: {B} seq(s), prefill + {case.steps} decode steps, every step matches "
        f"recomputation: max |err| {worst:.3g} ({tol})"
    )
