"""Token-stream tier: greedy streams through the real engine vs the reference backend.

Each case runs the backend under test and ``naive`` (same model, dtype and device) through
:class:`~kvcore.engine.core.Engine` with ``ignore_eos`` and compares the generated ids. float32 must match
exactly; reduced precision is tie-aware (see :mod:`kvcore.conformance.tolerances`): at the first
divergence both tokens must be in each other's top-k with a small logit gap, and the comparison stops
there. Variants: ``single-<i>`` (prompt ``i`` alone), ``batch`` (all prompts, one ragged batch) and
``churn``: continuous batching on one long-lived engine (one backend instance) with at most 3 requests
running and, over a paged cache, a block pool of about 1.5 requests' worth, so six requests of different
lengths join at different steps, finish at different steps and are preempted (and recomputed); every
stream must equal the same request run alone on the reference. Plans or masks memoised across steps by
shape, or state kept between calls, show here. ``recurring``: the same rule, with requests chosen so that
decode batches of one size and longest length come back with other per-slot lengths in other slots (the
longest request leaves first and queued ones refill its slot), which state kept per shape gets wrong.
``compiled``: a backend that declares
``capabilities.compilable`` runs the batch again with its decode steps through ``torch.compile``
(``EngineConfig.compile``), held to the same rule (float32: exact): what the capability promises.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcore.conformance.driver import ChurnRequest, Stream, run_churn, run_engine
from kvcore.conformance.model_cases import ModelCase, dtype_plan, tier_models
from kvcore.conformance.model_cases import skip_reasons as model_skip_reasons
from kvcore.conformance.models import get_model
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target, reference_target
from kvcore.conformance.tolerances import TieRule, tie_rule
from kvcore.execution.compile import compile_reasons
from kvcore.interfaces.sampler import SamplingParams

__all__ = ["NAME", "cases", "tolerance", "skip_reasons", "check", "compare_streams", "reference_streams"]

NAME = "stream"
TITLE = "Token streams: greedy generation vs the reference backend"

_REFERENCE_CACHE: dict[tuple, list[Stream]] = {}


def _new_tokens(model: str, quick: bool) -> int:
    if model in ("tiny", "tiny-local"):
        return 16 if quick else 32
    return 8 if quick else 24


def cases(target: Target, cfg: SuiteConfig) -> list[ModelCase]:
    out = []
    for dtype, reduced in dtype_plan(cfg):
        models = cfg.models[:1] if reduced else tier_models(cfg, first_only_when_quick=False)
        for model in models:
            n = _new_tokens(model, cfg.quick)
            singles = (1,) if cfg.quick or reduced else (0, 1, 2)
            out += [ModelCase(model, f"single-{i}", n, dtype) for i in singles]
            out.append(ModelCase(model, "batch", n, dtype))
            if model == models[0]:
                out.append(ModelCase(model, "churn", n, dtype))
                out.append(ModelCase(model, "recurring", n, dtype))
                out.append(ModelCase(model, "compiled", n, dtype))
    # the attention-variant dimension: a model with a local, soft-capped layer (kvcore/conformance/models.py)
    out += [ModelCase("tiny-local", variant, _new_tokens("tiny", cfg.quick)) for variant in ("single-1", "batch")]
    return out


def skip_reasons(target: Target, case: ModelCase, cfg: SuiteConfig) -> list[str]:
    """The model's and capabilities' reasons; for ``compiled``, also why decode steps cannot be compiled."""
    reasons = model_skip_reasons(target, case, cfg)
    if case.variant == "compiled" and not reasons:
        if cfg.tensor_parallel_size > 1:
            return ["compiled decode steps run in one process (tensor parallelism is on)"]
        reasons = compile_reasons(target.make(), cfg.torch_device)
    return reasons


def churn_requests(cm, n: int) -> list[ChurnRequest]:
    """Six requests of different lengths joining at different steps (``n``: the longest output)."""
    a, b, c = (list(p) for p in cm.prompts[:3])
    return [
        ChurnRequest(tuple(b), n, 0),
        ChurnRequest(tuple(a), max(2, n // 3), 0),
        ChurnRequest(tuple(c), n, 2),
        ChurnRequest(tuple(a + b[:4]), max(3, n // 2), 3),
        ChurnRequest(tuple(c[: max(1, len(c) * 2 // 3)]), max(2, n - 5), 5),
        ChurnRequest(tuple(reversed(b)), max(2, n // 4), 9),
    ]


def recurring_requests(cm, n: int) -> list[ChurnRequest]:
    """Three running requests, the longest (20 tokens) leaving first; queued requests refill its slot, the
    first with another 20-token prompt, so decode batches of the same size and longest length recur with
    other per-slot lengths, in other slots (``n``: the longest output)."""
    lens = ((20, 3), (8, n), (12, n), (20, max(4, n // 2)), (6, 4))
    return [ChurnRequest(tuple(cm.continuation(p, salt=f"recurring-{i}")), m, 0) for i, (p, m) in enumerate(lens)]


def _check_churn(target: Target, cm, case: ModelCase, cfg: SuiteConfig, result: CaseResult) -> None:
    requests = churn_requests(cm, case.steps) if case.variant == "churn" else recurring_requests(cm, case.steps)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    result.info.update(model=case.model, prompt_lens=[len(r.prompt) for r in requests],
                       new_tokens=[r.max_new_tokens for r in requests], join_steps=[r.join_step for r in requests])
    result.info["where"] = f"model {case.model}: continuous batching"
    # churn: a pool of about 1.5 requests forces preemptions; recurring: room for all, so nothing is preempted
    pool = longest * 3 // 2 if case.variant == "churn" else sum(len(r.prompt) + r.max_new_tokens for r in requests)
    got, facts = run_churn(target, cm, requests, cfg, max_num_seqs=3, num_blocks_tokens=pool)
    result.info.update(facts)
    ref = []
    for r in requests:
        params = greedy_params(r.max_new_tokens, 1)
        ref += reference_streams(cm, ("greedy-alone", r.prompt, r.max_new_tokens), [list(r.prompt)], params, cfg,
                                 target)
    prompts = [list(r.prompt) for r in requests]
    _judge(result, case, prompts, ref, got, tie_rule(cfg.dtype, target.unit_roundoff), cfg)
    if result.status != FAIL:
        result.detail += (f" ({len(requests)} requests alone on the reference vs one engine: {facts['engine_steps']} "
                          f"steps, {facts['preemptions']} preemption(s), {facts['recurring_shapes']} batch(es) "
                          "repeating an earlier shape with other lengths)")


def _prompts(cm, case: ModelCase) -> list[list[int]]:
    if case.variant in ("batch", "compiled"):
        return list(cm.prompts)
    return [cm.prompts[int(case.variant.split("-")[1]) % len(cm.prompts)]]


def greedy_params(n: int, count: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for _ in range(count)]


def reference_streams(cm, case_key: tuple, prompts, params, cfg: SuiteConfig, target: Target) -> list[Stream]:
    """The reference backend's streams with ``target``'s sampler, computed once per process for each
    (model, dtype, sampler, attention variants, case)."""
    key = (cm.name, cfg.dtype, cfg.device, target.sampler, tuple(sorted(target.sampler_options.items())),
           cfg.attention_variants, case_key)
    if key not in _REFERENCE_CACHE:
        one_rank = dataclasses.replace(cfg, tensor_parallel_size=1)  # a tensor-parallel run is held to one rank's
        _REFERENCE_CACHE[key] = run_engine(reference_target(target.registry), cm, prompts, params, one_rank,
                                           sampler=target.make_sampler())
    return _REFERENCE_CACHE[key]


def tolerance(target: Target, case: ModelCase, cfg: SuiteConfig) -> str:
    return str(tie_rule(cfg.dtype, target.unit_roundoff))


def check(target: Target, case: ModelCase, cfg: SuiteConfig, result: CaseResult) -> None:
    cm = get_model(case.model, cfg.dtype, cfg.device)
    if case.variant in ("churn", "recurring"):
        _check_churn(target, cm, case, cfg, result)
        return
    prompts = _prompts(cm, case)
    params = greedy_params(case.steps, len(prompts))
    result.info.update(model=case.model, prompt_lens=[len(p) for p in prompts], new_tokens=case.steps)
    compiled = case.variant == "compiled"
    result.info["where"] = f"model {case.model}: generation" + (", decode steps compiled" if compiled else "")
    variant = "batch" if compiled else case.variant  # the same streams as the batch case: one reference run
    ref = reference_streams(cm, ("greedy", variant, case.steps), prompts, params, cfg, target)
    got = run_engine(target, cm, prompts, params, cfg, compile=compiled)
    _judge(result, case, prompts, ref, got, tie_rule(cfg.dtype, target.unit_roundoff), cfg)


def _top(logits: torch.Tensor, k: int = 5) -> list[tuple[int, float]]:
    vals, idx = logits.topk(min(k, logits.numel()))
    return [(int(i), round(float(v), 4)) for v, i in zip(vals, idx)]


def compare_streams(ref: Stream, got: Stream, rule: TieRule) -> dict:
    """First divergence of two streams and whether it is an acceptable near-tie under ``rule``."""
    n = min(len(ref.tokens), len(got.tokens))
    step = next((i for i in range(n) if ref.tokens[i] != got.tokens[i]), None)
    if step is None:
        if len(ref.tokens) != len(got.tokens):
            return {"equal": False, "tie": False, "step": n, "why": f"lengths differ: {len(got.tokens)} vs "
                    f"reference {len(ref.tokens)}"}
        margins = [float(v[0] - v[1]) for v in (row.topk(2).values for row in ref.logits)] if len(ref.logits) else []
        low = min(range(len(margins)), key=margins.__getitem__) if margins else None
        return {"equal": True, "min_margin": margins[low] if margins else None, "min_margin_step": low}
    a, b = ref.tokens[step], got.tokens[step]
    rl, gl = ref.logits[step], got.logits[step]
    ref_gap = float(rl[a] - rl[b])  # how much the reference preferred its token
    got_gap = float(gl[b] - gl[a])  # how much the backend preferred its token
    k = min(rule.top_k, rl.numel())
    in_topk = b in rl.topk(k).indices.tolist() and a in gl.topk(k).indices.tolist()
    tie = (not rule.exact) and in_topk and ref_gap <= rule.max_gap and got_gap <= rule.max_gap
    return {
        "equal": False,
        "tie": tie,
        "step": step,
        "ref_token": a,
        "got_token": b,
        "ref_margin": ref_gap,
        "got_margin": got_gap,
        "in_topk": in_topk,
        "ref_top": _top(rl),
        "got_top": _top(gl),
    }


def _judge(result: CaseResult, case: ModelCase, prompts, ref: list[Stream], got: list[Stream], rule,
           cfg: SuiteConfig) -> None:
    notes = []
    selected = ", ".join(cfg.attention_variants)
    model = case.model + (f" (attention variants {selected})" if selected else "")
    for i, (r, g) in enumerate(zip(ref, got)):
        c = compare_streams(r, g, rule)
        label = f"seq {i} (prompt {len(prompts[i])} tokens)"
        if c["equal"]:
            if c.get("min_margin") is not None:
                notes.append(f"{label}: {len(r.tokens)} tokens identical (min top-2 margin "
                             f"{c['min_margin']:.3g} at step {c['min_margin_step']})")
            continue
        if c.get("tie"):
            notes.append(
                f"{label}: near-tie at step {c['step']} (reference {c['ref_token']} by {c['ref_margin']:.3g}, "
                f"backend {c['got_token']} by {c['got_margin']:.3g}); comparison stopped there"
            )
            result.info.setdefault("ties", []).append({"seq": i, **c})
            continue
        result.status = FAIL
        if "ref_token" not in c:
            result.detail = f"model {model}, {case.variant}: {label}: {c['why']}"
            return
        result.detail = (
            f"model {model}, {case.variant}: {label} diverges from the reference at step {c['step']} "
            f"(position {len(prompts[i]) + c['step']}): reference token {c['ref_token']} (it leads the backend's "
            f"token by {c['ref_margin']:.4g} in the reference logits), backend token {c['got_token']} (leads by "
            f"{c['got_margin']:.4g} in the backend's logits); rule: {rule}. Reference top-5 {c['ref_top']}; "
            f"backend top-5 {c['got_top']}. Reference {r.tokens[: c['step'] + 1]} vs backend "
            f"{g.tokens[: c['step'] + 1]}"
        )
        result.info.update(seq=i, **{k: v for k, v in c.items() if k != "equal"})
        return
    result.detail = f"model {model}: " + "; ".join(notes) if notes else f"model {model}: identical"
