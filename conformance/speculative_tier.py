"""Speculative tier: speculation must never change a stream, only how many tokens a forward yields.

Each case runs the backend under test (float32, the tiny model) with and without speculative decoding on
one engine configuration that exercises the rest of the core too: continuous batching (two requests at a
time, so requests join and leave), chunked prefill with a small token budget (prompt chunks share steps
with verification rows), ``n = 2``, a stop token, logprobs, and prefix caching over a paged cache.

* ``<proposer>-greedy``: greedy streams token-identical to those without speculation; logprobs equal up
  to float32 rounding, or over a lossy KV cache up to the rounding its declared ``unit_roundoff`` implies
  (:func:`kvcore.conformance.tolerances.logprob_tolerance`). With the oracle (every draft right), each
  verification must also yield ``K + 1`` tokens: a single request then needs exactly
  ``ceil((N - 1) / (K + 1))`` decode steps.
* ``<proposer>-sampled``: seeded sampled streams token-identical too (deterministic drafts go through the
  target's own seeded draws, see :mod:`kvcore.sampling.rejection`).
* ``random-distribution``: drafts drawn from a random ``q`` (the rejection rule): the joint distribution
  of two tokens sampled at temperature :data:`TEMPERATURE` (not 1: a rule or a proposer that forgets the
  temperature shows) over :data:`NUM_DRAWS` seeds against the exact target distribution, a chi-square test at
  false-alarm rate :data:`FALSE_ALARM` (fixed seeds: the same verdict every run); and every draft against the
  ``q`` reported with it (:mod:`kvcore.conformance.speculative_checks`), the same test and rate. The same for
  the proposer under test when it samples its drafts (``capabilities.deterministic`` False), whose sampled
  streams need not match.
* ``<proposer>-variants`` (the proposer under test): ``-greedy`` on ``tiny-local`` (sliding window, soft-cap).

Every case compares the target model (weights, config, each layer's attention settings) before and after it.

The proposers are the three of :mod:`kvcore.conformance.speculative_proposers` and, with ``kvcore
conformance --proposer NAME``, the proposer under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcore.conformance.limits import generate
from kvcore.conformance.models import get_model
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.speculative_checks import (
    DraftRecorder,
    chi2_quantile,
    model_changes,
    model_state,
    pit_uniformity,
)
from kvcore.conformance.speculative_proposers import ORACLE, RANDOM, REJECT_ALL, _key, plugin
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import logprob_tolerance
from kvcore.engine.core import Engine, EngineConfig
from kvcore.interfaces.layer_attention import variants_of
from kvcore.interfaces.sampler import SamplingParams

__all__ = ["NAME", "cases", "tolerance", "skip_reasons", "check", "FALSE_ALARM", "NUM_DRAWS"]

NAME = "speculative"
TITLE = "Speculative decoding: streams unchanged by proposals, sampled distribution kept"
K = 3  # drafts per step
FALSE_ALARM = 1e-3
NUM_DRAWS = 1500
TEMPERATURE = 0.7  # of the distribution case
_PLUGIN = "kvcore-conformance-proposers"
MODEL = "tiny"  # every case runs this conformance model (but ``-variants``)
VARIANTS_MODEL = "tiny-local"
DTYPE = "float32"  # in this precision: streams are compared exactly


@dataclass(frozen=True)
class SpecCase:
    proposer: str
    variant: str  # greedy / sampled / distribution / variants

    @property
    def id(self) -> str:
        return f"{self.proposer.removeprefix('conformance-')}-{self.variant}"


def cases(target: Target, cfg: SuiteConfig) -> list[SpecCase]:
    out = [SpecCase(p, v) for p in (ORACLE, REJECT_ALL, RANDOM) for v in ("greedy", "sampled")]
    out.append(SpecCase(RANDOM, "distribution"))
    if target.proposer is not None:
        out += [SpecCase(target.proposer, v) for v in ("greedy", "sampled", "distribution", "variants")]
    return out


def _deterministic(target: Target, proposer: str) -> bool:
    entry = target.registry.proposers.get(proposer)
    return entry is None or entry.cls.capabilities.deterministic


def tolerance(target: Target, case: SpecCase, cfg: SuiteConfig) -> str:
    if case.variant == "distribution":
        return f"chi-square, false alarms {FALSE_ALARM:g}"
    if case.variant in ("greedy", "variants"):
        return f"exact tokens, logprobs atol={logprob_tolerance(target.unit_roundoff):g}"
    return "exact tokens"


def skip_reasons(target: Target, case: SpecCase, cfg: SuiteConfig) -> list[str]:
    reasons = []
    if not target.capabilities.multi_token_decode:
        reasons.append(f"backend '{target.name}' does not declare multi-token decode")
    if cfg.tensor_parallel_size > 1:
        reasons.append("verification runs in one process (tensor parallelism is on)")
    if cfg.dtype != getattr(torch, DTYPE) and not reasons:
        reasons.append(f"streams are compared exactly: {DTYPE} only")
    if case.variant == "variants" and not reasons:
        layers = get_model(VARIANTS_MODEL, getattr(torch, DTYPE), "cpu").model.attention_layers
        reasons += target.capabilities.reasons_variants(variants_of(layers))
    if case.proposer == target.proposer and not reasons:
        deterministic = _deterministic(target, target.proposer)
        if case.variant == "sampled" and not deterministic:
            reasons.append("a proposer that samples its drafts keeps the distribution, not the stream: see "
                           f"{case.id.removesuffix('-sampled')}-distribution")
        if case.variant == "distribution" and deterministic:
            reasons.append("a deterministic proposer's sampled streams are compared token for token: see "
                           f"{case.id.removesuffix('-distribution')}-sampled")
    return reasons


def _engine(target: Target, cm, proposer: str | None, options: dict, max_len: int, seqs: int = 2,
            budget: int = 8) -> Engine:
    cache = target.cache_names()[0]
    paged = target.registry.kv_caches[cache].cls.paged
    config = EngineConfig(
        backend=target.name, kv_cache=cache, dtype=DTYPE, weights="float", lm_head="dense", device="cpu",
        max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=budget, enable_prefix_caching=paged,
        backend_options={target.name: dict(target.options)} if target.options else {},
        kv_cache_options={cache: dict(target.kv_cache_options)} if cache == target.kv_cache else {},
        check_backend_outputs=False, proposer=proposer, num_speculative_tokens=K,
        proposer_options={proposer: options} if proposer else {},
    )
    return Engine(cm.model, None, config, registry=target.registry, sampler=target.make_sampler())


def _requests(cm, sampled: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [list(p) for p in cm.prompts] + [list(cm.prompts[0]) * 2]
    n = 24
    if sampled:
        base = dict(temperature=0.9, top_k=40, max_new_tokens=n, ignore_eos=True)
        params = [SamplingParams(seed=11 + i, n=2 if i == 1 else 1, **base) for i in range(len(prompts))]
    else:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2 if i == 0 else None)
                  for i in range(len(prompts))]
    stop = params[2]  # a stop token: the stream ends where it would without speculation
    params[2] = SamplingParams(**{**_fields(stop), "stop_token_ids": (int(cm.prompts[0][-1]),)})
    return prompts, params


def _fields(p: SamplingParams) -> dict:
    names = ("max_new_tokens", "temperature", "top_k", "seed", "ignore_eos", "n", "logprobs")
    return {k: getattr(p, k) for k in names}


def _options(proposer: str, continuations: dict) -> dict:
    if proposer in (ORACLE, REJECT_ALL):
        return {"continuations": continuations}
    return {"seed": 5} if proposer == RANDOM else {}


def check(target: Target, case: SpecCase, cfg: SuiteConfig, result: CaseResult) -> None:
    cm = get_model(VARIANTS_MODEL if case.variant == "variants" else MODEL, getattr(torch, DTYPE), "cpu")
    registered = _PLUGIN in dict(target.registry.pm.list_name_plugin())
    if not registered:
        target.registry.register_plugin(plugin(), _PLUGIN)
    before = model_state(cm.model)
    try:
        if case.variant == "distribution":
            _check_distribution(target, cm, case.proposer, result)
        else:
            _check_streams(target, cm, case, result)
    finally:
        if not registered:
            target.registry.unregister_plugin(_PLUGIN)
        change = model_changes(before, cm.model)
        if change is not None:
            get_model.cache_clear()  # later cases get the model as made, not as this proposer left it
            result.status = FAIL
            result.detail = f"proposer '{case.proposer}' changed the target model: {change}"


def _check_streams(target: Target, cm, case: SpecCase, result: CaseResult) -> None:
    prompts, params = _requests(cm, case.variant == "sampled")
    max_len = max(len(p) for p in prompts) + 32
    result.info["where"] = "generation without speculation"
    ref = generate(_engine(target, cm, None, {}, max_len), prompts, params)
    continuations = {_key(r.prompt_token_ids): r.token_ids for r in ref}
    result.info["where"] = f"generation with proposer '{case.proposer}'"
    engine = _engine(target, cm, case.proposer, _options(case.proposer, continuations), max_len)
    got = generate(engine, prompts, params)
    stats = engine.stats
    result.info.update(draft_tokens=stats.num_draft_tokens, accepted_tokens=stats.num_accepted_tokens,
                       verify_steps=stats.num_spec_steps)
    tol, worst = logprob_tolerance(target.unit_roundoff), 0.0
    for i, (a, b) in enumerate(zip(ref, got)):
        if b.error is not None:
            result.status, result.detail = FAIL, f"stream {i} failed: {b.error}"
            return
        if a.token_ids != b.token_ids:
            at = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                      min(len(a.token_ids), len(b.token_ids)))
            result.status = FAIL
            result.detail = (f"stream {i} differs from the stream without speculation at token {at}: "
                             f"{b.token_ids[at:at + 4]} instead of {a.token_ids[at:at + 4]}")
            return
        err = max((abs(x - y) for x, y in zip(a.logprobs or (), b.logprobs or ())), default=0.0)
        worst = max(worst, err)
        if err > tol:
            result.status, result.max_err = FAIL, err
            result.detail = (f"stream {i}: logprobs differ from those without speculation by up to {err:.3g} "
                             f"(atol {tol:g})")
            return
    if not stats.num_draft_tokens and case.proposer in (ORACLE, REJECT_ALL, RANDOM):
        result.status, result.detail = FAIL, "no draft token was verified: speculation never ran"
        return
    oracle = case.proposer == ORACLE and case.variant == "greedy"
    if oracle and not _oracle_yields_all(target, cm, prompts[3], continuations, max_len, result):
        return
    result.detail = (f"{len(ref)} streams identical; {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts "
                     f"kept over {stats.num_spec_steps} verifications")
    if case.variant == "greedy":
        result.max_err = worst
        result.detail += f"; logprobs within {worst:.3g} (atol {tol:g})"


def _oracle_yields_all(target: Target, cm, prompt, continuations, max_len: int, result: CaseResult) -> bool:
    """One request alone with every draft right: each decode step must emit K + 1 tokens."""
    n = 24
    engine = _engine(target, cm, ORACLE, {"continuations": continuations}, max_len, seqs=1)
    out = generate(engine, [prompt], [SamplingParams(max_new_tokens=n, ignore_eos=True)])[0]
    expected = math.ceil((n - 1) / (K + 1))
    if len(out.token_ids) != n or engine.stats.num_decode_tokens != expected:
        result.status = FAIL
        result.detail = (f"with every draft right, {n} tokens took {engine.stats.num_decode_tokens} decode steps "
                         f"({len(out.token_ids)} tokens) instead of {expected}: a verification dropped tokens "
                         "it had accepted (the bonus token?)")
        return False
    return True


def _check_distribution(target: Target, cm, proposer: str, result: CaseResult) -> None:
    """Tokens sampled (top-k 3) per seed, the second through the rejection rule (the first comes from the
    prefill, a third leaves room for one draft): the joint counts of (first, second) against
    p(first) p(second | first). The drafts come from the built-in random ``q``, or from the proposer under
    test (which must propose some: a case that verified no draft checks nothing)."""
    prompt = list(cm.prompts[1])
    base = dict(temperature=TEMPERATURE, top_k=3, max_new_tokens=3, ignore_eos=True)
    result.info["where"] = "the exact target distribution"
    exact = _engine(target, cm, None, {}, len(prompt) + 8, seqs=1)
    first = _top(exact, prompt, base)
    joint = {}
    for t1, p1 in first.items():
        for t2, p2 in _top(exact, prompt + [t1], base).items():
            joint[(t1, t2)] = p1 * p2
    result.info["where"] = f"sampling with drafts from proposer '{proposer}'"
    # q over the tokens the target can pick and as many it cannot: drafts are kept and rejected alike
    support = sorted({t for pair in joint for t in pair} | set(range(len(joint))))
    options = {"seed": 7, "sampled": True, "support": support} if proposer == RANDOM else {}
    engine = _engine(target, cm, proposer, options, len(prompt) + 8, seqs=64, budget=4096)
    drafts = DraftRecorder(engine.speculator.proposer)
    outs = generate(engine, [prompt] * NUM_DRAWS, [SamplingParams(seed=1000 + i, **base) for i in range(NUM_DRAWS)])
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        pair = tuple(o.token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    outside = sum(c for k, c in counts.items() if k not in joint)
    chi2 = sum((counts.get(k, 0) - NUM_DRAWS * p) ** 2 / (NUM_DRAWS * p) for k, p in joint.items())
    dof = len(joint) - 1
    limit = chi2_quantile(1 - FALSE_ALARM, dof)
    result.info.update(chi2=chi2, dof=dof, limit=limit, draft_tokens=engine.stats.num_draft_tokens,
                       accepted_tokens=engine.stats.num_accepted_tokens)
    if not engine.stats.num_draft_tokens:
        result.status, result.detail = FAIL, f"proposer '{proposer}' proposed no draft: the rejection rule never ran"
        return
    if outside or chi2 > limit:
        result.status = FAIL
        result.detail = (f"sampled pairs at temperature {TEMPERATURE} do not follow the target distribution: chi2 "
                         f"{chi2:.1f} > {limit:.1f} (dof {dof}) or {outside} pair(s) it cannot produce")
        return
    result.detail = (f"temperature {TEMPERATURE}: chi2 {chi2:.1f} <= {limit:.1f} (dof {dof}, {NUM_DRAWS} draws, "
                     f"{engine.stats.num_accepted_tokens}/{engine.stats.num_draft_tokens} drafts kept)")
    if drafts.draws:
        q_chi2, q_dof = pit_uniformity(drafts.draws)
        q_limit = chi2_quantile(1 - FALSE_ALARM, q_dof)
        result.info.update(q_chi2=q_chi2, q_draws=len(drafts.draws))
        if q_chi2 > q_limit:
            result.status = FAIL
            result.detail = (f"the drafts of proposer '{proposer}' were not drawn from the q it reports with them: "
                             f"over {len(drafts.draws)} drafts, the probability integral transform gives chi2 "
                             f"{q_chi2:.1f} > {q_limit:.1f} (dof {q_dof}) against uniform")
            return
        result.detail += f"; {len(drafts.draws)} drafts fit their reported q (chi2 {q_chi2:.1f} <= {q_limit:.1f})"


def _top(engine: Engine, prompt: list[int], base: dict) -> dict[int, float]:
    """The processed next-token distribution after ``prompt`` (top-k 3 at temperature 1)."""
    out = generate(engine, [prompt], [SamplingParams(seed=0, logprobs=3, **{**base, "max_new_tokens": 1})])[0]
    return {t: math.exp(lp) for t, lp in out.top_logprobs[0]}
