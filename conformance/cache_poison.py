"""The cache tier's ``poisoned`` case: what a finished request leaves in the KV cache never reaches a later one.

Script, for each cache the target is tested over (``Target.cache_names``), on the run's first model and the backend
under test, in a pool with room for exactly two sequences: two requests whose keys and values went bad fill every
slot and block (one with NaN, one with the dtype's largest finite value) and are freed; then the model's shortest
and longest prompts take their place, prefill together and decode together, teacher-forced, so that the short
one shares every decode step with a longer one. Each forward's logits must equal those of the same calls on a
fresh cache (within the cache tier's tolerance).

What fails it: a cache whose readers read rows past a sequence's length (padding a batch to its longest
sequence, whole blocks) and that does not clear what freed slots hold before a new sequence starts there
(``KVCache.before_forward``); a backend that reads such rows and masks them by weight (``0 × NaN`` is NaN) or by
a finite offset (a huge score outweighs it) instead of leaving them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.conformance.cases import dtype_suffix
from kvcore.conformance.compare import compare
from kvcore.conformance.driver import cache_spec, forward_logits
from kvcore.conformance.models import ConformanceModel, get_model
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import cache_tolerance
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = ["PoisonCase", "check_poisoned"]

_STEPS = 4
_BLOCK = 16
_POISON_IDS = (100, 101)  # the failed requests' sequence ids; the later ones are 0 (short) and 1 (long)


@dataclass(frozen=True)
class PoisonCase:
    """Every cache the target is tested over (known only when the case runs), poisoned and reused."""

    model: str
    dtype: torch.dtype | None = None

    @property
    def id(self) -> str:
        return f"poisoned{dtype_suffix(self.dtype)}"


def _poison_forward(backend, values: torch.Tensor):
    """``backend.forward`` writing ``values`` (``[T]``, one per token) as every element of the call's K and V."""
    real = backend.forward

    def forward(layer_idx, q, k, v, cache, plan):
        bad = values.to(k.device, k.dtype)[:, None, None].expand_as(k).contiguous()
        return real(layer_idx, q, bad, bad.clone(), cache, plan)

    return forward


def _run(cm: ConformanceModel, target: Target, cache: str, cfg: SuiteConfig, poisoned: bool,
         result: CaseResult) -> list[torch.Tensor]:
    """Logits ``[2, V]`` of each forward of the short and long sequences (prefill, then each decode step), on a
    cache first filled with poison and freed when ``poisoned``."""
    short, long = min(cm.prompts, key=len), max(cm.prompts, key=len)
    conts = [cm.continuation(_STEPS, salt=str(i)) for i in range(2)]
    max_len = -(-(len(long) + _STEPS) // _BLOCK) * _BLOCK  # whole blocks: the two poisoned requests fill the pool
    backend = target.make()
    kv = KVCacheManager(target.make_cache(cache, cache_spec(cm, cfg, 2, max_len, _BLOCK)))
    if poisoned:
        result.info["where"] = "writing the poisoned requests"
        chunks = [cm.continuation(max_len, salt=f"poison{i}") for i in range(2)]
        big = torch.finfo(cm.model.dtype).max
        values = torch.tensor([float("nan")] * max_len + [big] * max_len)
        for s in _POISON_IDS:
            kv.add_sequence(s)
        backend.forward = _poison_forward(backend, values)
        try:
            forward_logits(cm, backend, kv, _POISON_IDS, chunks)
        finally:
            del backend.forward
        for s in _POISON_IDS:
            kv.free_sequence(s)
    for s in (0, 1):
        kv.add_sequence(s)
    result.info["where"] = f"{'poisoned' if poisoned else 'fresh'} cache: prefill"
    out = [forward_logits(cm, backend, kv, (0, 1), [short, long])]
    for step in range(_STEPS):
        result.info["where"] = f"{'poisoned' if poisoned else 'fresh'} cache: decode step {step + 1}"
        out.append(forward_logits(cm, backend, kv, (0, 1), [[conts[0][step]], [conts[1][step]]]))
    return out


def check_poisoned(target: Target, case: PoisonCase, cfg: SuiteConfig, result: CaseResult) -> None:
    cm = get_model(case.model, cfg.dtype, cfg.device)
    tol = cache_tolerance(cfg.dtype, target.unit_roundoff)
    lens = sorted(len(p) for p in cm.prompts)
    result.info.update(model=case.model, steps=_STEPS)
    worst = 0.0
    for cache in target.cache_names():
        result.info["kv_cache"] = cache
        reused = _run(cm, target, cache, cfg, True, result)
        fresh = _run(cm, target, cache, cfg, False, result)
        for step, (got, want) in enumerate(zip(reused, fresh)):
            for seq in (0, 1):
                m = compare(got[seq], want[seq], tol)
                worst = max(worst, m.max_err)
                if m.ok:
                    continue
                phase = "prefill" if step == 0 else f"decode step {step}"
                nan = int(torch.isnan(got[seq]).sum())
                result.status, result.max_err = FAIL, m.max_err
                result.detail = (
                    f"stale K/V: model {case.model}, KV cache '{cache}': two requests left NaN and "
                    f"{torch.finfo(cm.model.dtype).max:.3g} in every slot and block and were freed; at {phase}, "
                    f"{'the short' if seq == 0 else 'the long'} sequence (prompts of {lens[0]} and {lens[-1]} tokens "
                    f"sharing the step) gets logits that differ from a fresh cache's: max |err| {m.max_err:.3g} "
                    f"({tol}), {m.num_bad}/{m.numel} off, {nan} NaN"
                )
                result.info.update(step=step, seq=seq)
                return
    result.max_err = worst
    result.detail = (f"KV cache {', '.join(target.cache_names())}: after two requests left NaN and huge K/V in every "
                     f"slot, a {lens[0]}- and a {lens[-1]}-token request reusing them decode as on a fresh cache: "
                     f"max |err| {worst:.3g} ({tol})")
