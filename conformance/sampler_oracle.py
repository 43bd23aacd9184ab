"""The sampler oracle: the sampler under test, called directly on synthetic logits, against kvcore's reference
(:mod:`kvcore.conformance.sampler_reference`), never against itself.

Each ``draws`` case builds one row (logits over a 64-token vocabulary, a prompt and output history, one
:class:`~kvcore.sampling.sampler.SamplingParams`) and asks the sampler for it ``NUM_DRAWS`` times at once, every copy
with its own seed. Greedy rows must all return the first maximum of the processed logits. Sampled rows must
never return a token the reference removes, and the counts must fit the reference's probabilities (Pearson's
chi-square; classes expected fewer than 10 times are pooled). A sampler that declares a feature
(``Sampler.features``) is held to the reference for it; for a feature it leaves out its draws are held to the
distribution its own :meth:`~kvcore.sampling.sampler.Sampler.logprobs` states. Declaring ``logprobs``: that method must
return the reference's log-probabilities too.

False alarms: the chi-square tests of one run share ``FAMILY_ALPHA`` (Bonferroni), so a correct sampler fails a
run with probability at most 1e-3. Draws are seeded from ``SuiteConfig.seed``: a run is reproducible, and
another seed is another independent trial (``benchmarks/sampler_false_alarms.py`` counts failures over many).

``independence``: rows of different requests batched together, each row alone, the batch permuted and run
again must give every seeded row the same token (and, off CPU, the same tokens on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.sampler_reference import Level, RowReference, features_used, reference_row
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.interfaces.sampler import Sampler, SamplingParams
from kvcore.sampling.sampler import sample_checked

__all__ = ["OracleCase", "oracle_cases", "check_oracle", "chi_square", "NUM_DRAWS", "FAMILY_ALPHA", "VOCAB"]

VOCAB = 64
#: tokens whose logit is -inf in every scenario; the history of scenarios without penalties uses them, so a
#: penalty a sampler applies on its own changes nothing there
_MASKED = tuple(range(56, 64))
NUM_DRAWS = 1000
_GREEDY_ROWS = 32
#: probability that a correct sampler fails any chi-square test of one run (split evenly between the tests)
FAMILY_ALPHA = 1e-3
_MIN_EXPECTED = 10.0
#: a sampler's logprobs() must agree with the reference to this (absolute, in nats; finite entries)
LOGPROB_ATOL = 1e-4


@dataclass(frozen=True)
class _Row:
    """A :class:`~kvcore.sampling.sampler.SamplingRow` made up for the oracle."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class Scenario:
    name: str
    feature: str  # what a failure names
    logits: tuple[float, ...]
    params: SamplingParams
    prompt_ids: tuple[int, ...] = _MASKED[:4]
    output_ids: tuple[int, ...] = _MASKED[4:6]

    def row(self, seed: int, request_id: str) -> _Row:
        return _Row(request_id, list(self.prompt_ids), list(self.output_ids), self.params, seed)

    def reference(self) -> RowReference:
        return reference_row(torch.tensor(self.logits), self.prompt_ids, self.output_ids, self.params)


@dataclass(frozen=True)
class OracleCase:
    kind: str  # "draws" or "independence"
    scenario: Scenario | None = None
    dtype: None = None  # logits reach a sampler in float32 whatever the model dtype
    index: int = field(default=0, compare=False)

    @property
    def id(self) -> str:
        return f"oracle-{self.scenario.name if self.scenario else self.kind}"


def _base_logits() -> list[float]:
    """56 logits drawn once from a fixed seed, rounded to multiples of 1/64 (exact in float32, so ties made
    below stay ties in every precision), then the masked tokens."""
    g = torch.Generator().manual_seed(20240607)
    x = (torch.randn(56, generator=g) * 1.5 * 64).round() / 64
    return x.tolist() + [-math.inf] * len(_MASKED)


def _with(values: dict[int, float], base: list[float] | None = None, fill: float | None = None) -> tuple[float, ...]:
    x = list(base if base is not None else _base_logits())
    if fill is not None:
        x = [fill] * 56 + [-math.inf] * len(_MASKED)
    for i, v in values.items():
        x[i] = v
    return tuple(x)


def _penalty_logits() -> tuple[float, ...]:
    """Small base logits (|x| <= 0.25) and four stand-outs: 10 (in the prompt), 20 (in the output, three
    times), 30 (in neither), 11 (negative, in the prompt)."""
    small = [v / 8 for v in _base_logits()[:56]] + [-math.inf] * len(_MASKED)
    small = [max(-0.25, min(0.25, v)) if v != -math.inf else v for v in small]
    return _with({10: 4.0, 20: 3.5, 30: 3.0, 11: -0.5}, small)


def scenarios() -> list[Scenario]:
    base = tuple(_base_logits())
    top = max(base)
    low = min(range(56), key=lambda i: base[i])
    argtop = base.index(top)
    pen = _penalty_logits()
    hist = {"prompt_ids": (10, 11, 12, 10), "output_ids": (20, 5, 20, 20)}
    P = SamplingParams  # noqa: N806
    return [
        Scenario("greedy", "greedy (argmax of the processed logits)", base, P(temperature=0.0)),
        Scenario("greedy-tie", "greedy (a tie goes to the first maximum, as torch.argmax)",
                 _with({3: top + 1, 40: top + 1}, list(base)), P(temperature=0.0)),
        Scenario("temperature-1", "temperature 1", base, P(temperature=1.0)),
        Scenario("temperature-0.5", "temperature 0.5", base, P(temperature=0.5)),
        Scenario("temperature-2", "temperature 2", base, P(temperature=2.0)),
        Scenario("top_k", "top_k 5", base, P(temperature=1.0, top_k=5)),
        Scenario("top_k-tie", "top_k 2 cutting a three-way tie", _with({7: top + 1, 8: top, 9: top}, list(base)),
                 P(temperature=1.0, top_k=2)),
        Scenario("top_p", "top_p 0.8", base, P(temperature=1.0, top_p=0.8)),
        Scenario("top_p-boundary", "top_p 0.75 exactly at a cumulative boundary (4 tokens of 0.25)",
                 _with({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, fill=-math.inf), P(temperature=1.0, top_p=0.75)),
        Scenario("top_k-top_p", "top_k 20 then top_p 0.9 at temperature 0.8", base,
                 P(temperature=0.8, top_k=20, top_p=0.9)),
        Scenario("min_p", "min_p 0.1", base, P(temperature=1.0, min_p=0.1)),
        Scenario("min_p-1", "min_p 1 (only tokens tied with the top stay)",
                 _with({4: top + 1, 14: top + 1, 24: top + 1}, list(base)), P(temperature=1.0, min_p=1.0)),
        Scenario("repetition_penalty-greedy", "repetition_penalty over prompt + output tokens (greedy)", pen,
                 P(temperature=0.0, repetition_penalty=2.0), **hist),
        Scenario("repetition_penalty", "repetition_penalty over prompt + output tokens", pen,
                 P(temperature=1.0, repetition_penalty=1.5), **hist),
        Scenario("frequency_penalty-greedy", "frequency_penalty and presence_penalty over output tokens (greedy)",
                 pen, P(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5), **hist),
        Scenario("presence_penalty", "presence_penalty over output tokens", pen,
                 P(temperature=1.0, presence_penalty=1.5), **hist),
        Scenario("frequency_penalty", "frequency_penalty over output tokens", pen,
                 P(temperature=1.0, frequency_penalty=0.7), **hist),
        Scenario("logit_bias-greedy", "logit_bias (greedy)", base,
                 P(temperature=0.0, logit_bias={low: 9.0, argtop: -100.0})),
        Scenario("logit_bias", "logit_bias", base, P(temperature=1.0, logit_bias={low: 4.0, argtop: -100.0})),
    ]


def oracle_cases() -> list[OracleCase]:
    found = [OracleCase("draws", s, index=i) for i, s in enumerate(scenarios())]
    return found + [OracleCase("independence", index=len(found))]


def _num_chi_square_tests() -> int:
    return sum(not s.params.is_greedy for s in scenarios())


def _seed(cfg: SuiteConfig, case: OracleCase, i: int) -> int:
    return (cfg.seed << 24) + (case.index << 14) + i


def chi_square(draws: Sequence[int], levels: Sequence[Level]) -> tuple[float, int, float]:
    """``(statistic, degrees of freedom, p-value)`` of ``draws`` against ``levels``: every kept token of an uncut
    level is a class, a cut tie one class (its kept share); classes expected under ``_MIN_EXPECTED`` times are
    pooled. ``dof == 0``: one class, nothing to test (p-value 1)."""
    n = len(draws)
    counts: dict[int, int] = {}
    for t in draws:
        counts[t] = counts.get(t, 0) + 1
    classes = []  # (expected, observed)
    for lv in levels:
        if not lv.kept:
            continue
        if lv.is_ambiguous:
            classes.append((n * lv.prob * lv.kept, sum(counts.get(t, 0) for t in lv.tokens)))
        else:
            classes += [(n * lv.prob, counts.get(t, 0)) for t in lv.tokens]
    classes.sort()
    pooled = []
    pool_e = pool_o = 0.0
    for e, o in classes:
        if pool_e < _MIN_EXPECTED and e < _MIN_EXPECTED:
            pool_e, pool_o = pool_e + e, pool_o + o
        else:
            pooled.append((e, o))
    if pool_e:
        if pool_e < _MIN_EXPECTED and pooled:
            e, o = pooled.pop(0)
            pool_e, pool_o = pool_e + e, pool_o + o
        pooled.append((pool_e, pool_o))
    dof = len(pooled) - 1
    if dof < 1:
        return 0.0, 0, 1.0
    stat = sum((o - e) ** 2 / e for e, o in pooled)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p


def _own_reference(sampler: Sampler, logits: torch.Tensor, row: _Row) -> RowReference:
    """The distribution the sampler's ``logprobs()`` states for ``row`` (for features it does not declare)."""
    lp = sampler.logprobs(logits[None].clone(), [row])[0].double().cpu()
    if row.params.is_greedy:
        return RowReference(lp, int(torch.argmax(lp)), ())
    probs = lp.exp()
    probs = probs / probs.sum()
    return RowReference(lp, None, tuple(Level(float(lp[t]), (t,), 1, float(probs[t]))
                                        for t in range(lp.numel()) if probs[t] > 0))


def check_oracle(target: Target, case: OracleCase, cfg: SuiteConfig, result: CaseResult) -> None:
    sampler = target.make_sampler()
    if case.kind == "independence":
        _check_independence(sampler, case, cfg, result)
    else:
        _check_draws(sampler, case, cfg, result)


def _fail(result: CaseResult, feature: str, message: str, **info) -> None:
    result.status = FAIL
    result.detail = f"sampler feature {feature}: {message}"
    result.info.update(feature=feature, **info)


def _check_draws(sampler: Sampler, case: OracleCase, cfg: SuiteConfig, result: CaseResult) -> None:
    sc = case.scenario
    device = cfg.torch_device
    logits = torch.tensor(sc.logits, dtype=torch.float32, device=device)
    used = features_used(sc.params)
    undeclared = sorted(used - set(sampler.features))
    result.info.update(feature=sc.feature, uses=sorted(used), params=repr(sc.params))
    result.info["where"] = f"scenario {sc.name}: the reference"
    if undeclared:
        ref = _own_reference(sampler, logits, sc.row(0, "own"))
        against = f"its own logprobs() (it does not declare {', '.join(undeclared)})"
    else:
        ref = sc.reference()
        against = "the reference"
        if "logprobs" in sampler.features:
            result.info["where"] = f"scenario {sc.name}: logprobs()"
            problem = _logprobs_problem(sampler, logits, sc, ref)
            if problem:
                _fail(result, f"logprobs ({sc.feature})", problem)
                return
    num = _GREEDY_ROWS if sc.params.is_greedy else NUM_DRAWS
    rows = [sc.row(_seed(cfg, case, i), f"oracle-{i}") for i in range(num)]
    result.info["where"] = f"scenario {sc.name}: sample() of {num} rows"
    draws, _ = sample_checked(sampler, logits[None].expand(num, -1).clone(), rows)
    if sc.params.is_greedy:
        wrong = [(i, t) for i, t in enumerate(draws) if t != ref.greedy_token]
        if wrong:
            i, t = wrong[0]
            x = ref.processed
            _fail(result, sc.feature, f"{len(wrong)}/{num} greedy rows returned another token than {against}: row {i} "
                  f"returned {t} (processed logit {float(x[t]):.4g}), expected {ref.greedy_token} (processed logit "
                  f"{float(x[ref.greedy_token]):.4g})", expected=ref.greedy_token, got=t)
            return
        result.detail = f"{sc.feature}: {num} greedy rows all returned token {ref.greedy_token} ({against})"
        return
    support = ref.support
    outside = sorted({t for t in draws if t not in support})
    if outside:
        t = outside[0]
        _fail(result, sc.feature, f"drew token {t} ({sum(d == t for d in draws)} of {num} draws), which {against} "
              f"removes (probability 0); kept tokens: {sorted(support)[:12]}", token=t)
        return
    for lv in ref.levels:
        if lv.is_ambiguous:
            seen = sorted({t for t in draws if t in lv.tokens})
            if len(seen) > lv.kept:
                _fail(result, sc.feature, f"drew {len(seen)} distinct tokens {seen} of a tie of {len(lv.tokens)} "
                      f"where only {lv.kept} may stay", tie=list(lv.tokens), kept=lv.kept)
                return
    stat, dof, p = chi_square(draws, ref.levels)
    alpha = FAMILY_ALPHA / _num_chi_square_tests()
    result.info.update(chi_square=stat, dof=dof, p_value=p, alpha=alpha)
    if p < alpha:
        counts = sorted(((draws.count(t), t) for t in set(draws)), reverse=True)[:5]
        expected = sorted(((lv.prob * num, lv.tokens[0]) for lv in ref.levels if lv.kept), reverse=True)[:5]
        _fail(result, sc.feature, f"the {num} draws do not fit {against}: chi-square {stat:.1f} on {dof} degrees of "
              f"freedom, p = {p:.2g} < {alpha:.2g}; most drawn (count, token) {counts}, expected "
              f"{[(round(e, 1), t) for e, t in expected]}", p_value=p)
        return
    result.detail = (f"{sc.feature}: {num} seeded draws fit {against} (chi-square {stat:.1f}, {dof} dof, "
                     f"p = {p:.3g} >= {alpha:.2g})")


def _logprobs_problem(sampler: Sampler, logits: torch.Tensor, sc: Scenario, ref: RowReference) -> str | None:
    got = sampler.logprobs(logits[None].expand(2, -1).clone(), [sc.row(1, "lp-0"), sc.row(2, "lp-1")])
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (2, VOCAB):
        return f"logprobs() returned {getattr(got, 'shape', type(got).__name__)}, expected a (2, {VOCAB}) tensor"
    got = got[0].double().cpu()
    want, cut = ref.logprobs()
    for lv in cut:
        finite = [t for t in lv.tokens if math.isfinite(float(got[t]))]
        if len(finite) != lv.kept:
            return f"{len(finite)} tokens of the tie {list(lv.tokens)} have a log-probability; {lv.kept} should"
        want[finite] = math.log(lv.prob)
        want[[t for t in lv.tokens if t not in finite]] = -math.inf
    removed = torch.isinf(want) & (want < 0)
    wrong_removed = removed != (torch.isinf(got) & (got < 0))
    if bool(wrong_removed.any()):
        t = int(wrong_removed.nonzero()[0])
        return f"token {t}: log-probability {float(got[t]):.4g}, the reference {float(want[t]):.4g}"
    err = (got - want).abs().masked_fill(removed, 0.0)
    if float(err.max()) > LOGPROB_ATOL:
        t = int(err.argmax())
        return (f"token {t}: log-probability {float(got[t]):.6g}, the reference {float(want[t]):.6g} "
                f"(|err| {float(err.max()):.3g} > {LOGPROB_ATOL})")
    return None


def _check_independence(sampler: Sampler, case: OracleCase, cfg: SuiteConfig, result: CaseResult) -> None:
    """One row of every scenario (each its own seed and history) as one batch; then each alone, the batch
    reversed and interleaved, and (off CPU) the batch on CPU: every row's token must stay the same."""
    device = cfg.torch_device
    picked = scenarios()
    rows = [sc.row(_seed(cfg, case, i), f"row-{i}") for i, sc in enumerate(picked)]
    logits = torch.tensor([sc.logits for sc in picked], dtype=torch.float32)

    def run(order: list[int], where: torch.device) -> list[int]:
        ids, _ = sample_checked(sampler, logits[order].to(where).clone(), [rows[i] for i in order])
        return [ids[order.index(i)] for i in range(len(rows)) if i in order] if len(order) == len(rows) else ids

    n = len(rows)
    result.info["where"] = "independence: the batch"
    batched = run(list(range(n)), device)
    trials = [("the same batch again", list(range(n)), device), ("the batch reversed", list(range(n))[::-1], device),
              ("the batch interleaved", list(range(0, n, 2)) + list(range(1, n, 2)), device)]
    if device.type != "cpu":
        trials.append(("the batch on cpu", list(range(n)), torch.device("cpu")))
    for what, order, where in trials:
        result.info["where"] = f"independence: {what}"
        got = run(order, where)
        for i in range(n):
            if got[i] != batched[i]:
                _fail(result, "seed (a seeded row's draws depend only on its own request)",
                      f"row {i} ({picked[i].name}, seed {rows[i].seed}) drew token {batched[i]} in a batch of {n} but "
                      f"{got[i]} in {what}", row=i)
                return
    for i in range(n):
        result.info["where"] = f"independence: row {i} alone"
        alone = run([i], device)[0]
        if alone != batched[i]:
            _fail(result, "seed (a seeded row's draws depend only on its own request)",
                  f"row {i} ({picked[i].name}, seed {rows[i].seed}) drew token {batched[i]} in a batch of {n} but "
                  f"{alone} alone", row=i)
            return
    result.detail = f"{n} seeded rows: the same tokens batched, alone, reordered" + (
        " and on cpu" if device.type != "cpu" else "")
