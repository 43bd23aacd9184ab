"""The sampler oracle: the sampler under test, called directly on synthetic logits, against kvcore's reference
(:mod:`kvcore.conformance.sampler_reference`), never against itself.

Each ``draws`` case builds one row (logits over a 64-token vocabulary, a prompt and output history, one
:class:`~kvcore.sampling.sampler.SamplingParams`) and asks the sampler for it ``NUM_DRAWS`` times at once, every copy
with its own seed. Greedy rows must all return the first maximum of the processed logits. Sampled rows must
never return a token the reference removes, must return every token it keeps that is expected
``COVERAGE_MIN_EXPECTED`` times or more (from a tie a filter cuts, exactly as many distinct tokens as it keeps: a
top-k, top-p or min-p boundary one token off shows here although the chi-square test may not see it), and the
counts must fit the reference's probabilities (Pearson's chi-square; classes expected fewer than 10 times are
pooled). A sampler that declares a feature
(``Sampler.features``) is held to the reference for it; for a feature it leaves out its draws are held to the
distribution its own :meth:`~kvcore.sampling.sampler.Sampler.logprobs` states. Declaring ``logprobs``: that method must
return the reference's log-probabilities too.

False alarms: the chi-square tests of one run share ``FAMILY_ALPHA`` (Bonferroni), so a correct sampler fails
them with probability at most 1e-3; the coverage checks add at most :func:`coverage_false_alarm` per scenario
(under 1e-9 in all). Draws are seeded from ``SuiteConfig.seed``: a run is reproducible, and
another seed is another independent trial (``benchmarks/studies/sampler_false_alarms.py`` counts failures over many).

``independence``: rows of different requests batched together, each row alone, the batch permuted and run
again must give every seeded row the same token (and, off CPU, the same tokens on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.sampler_reference import Level, RowReference, features_used
from kvcore.conformance.sampler_scenarios import (
    FAMILY_ALPHA,
    GREEDY_ROWS,
    NUM_DRAWS,
    VOCAB,
    OracleCase,
    Row,
    Scenario,
    num_chi_square_tests,
    scenarios,
)
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.interfaces.sampler import Sampler
from kvcore.sampling.sampler import sample_checked

__all__ = ["check_oracle", "chi_square", "coverage_false_alarm", "COVERAGE_MIN_EXPECTED"]

_MIN_EXPECTED = 10.0
#: a kept token expected at least this many times in a scenario's draws must be drawn: a correct sampler misses
#: one with probability at most exp(-COVERAGE_MIN_EXPECTED) (:func:`coverage_false_alarm` sums them)
COVERAGE_MIN_EXPECTED = 20.0
#: a sampler's logprobs() must agree with the reference to this (absolute, in nats; finite entries)
LOGPROB_ATOL = 1e-4


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


def _covered(levels: Sequence[Level], n: int) -> list[Level]:
    """The kept levels each of whose kept tokens ``n`` draws are expected to return ``COVERAGE_MIN_EXPECTED`` times
    or more: a correct sampler draws every one of them (or, from a cut tie, exactly ``kept`` distinct ones)."""
    return [lv for lv in levels if lv.kept and n * lv.prob >= COVERAGE_MIN_EXPECTED]


def coverage_false_alarm(levels: Sequence[Level], n: int) -> float:
    """A bound on the probability that ``n`` draws of a correct sampler miss a token :func:`_covered` requires:
    ``(1 - p) ** n`` per kept token of probability ``p`` (union bound)."""
    return sum(lv.kept * (1 - lv.prob) ** n for lv in _covered(levels, n))


def _unseen(draws: Sequence[int], levels: Sequence[Level], against: str) -> str | None:
    """The first token the draws should have returned and never did (a filter boundary one token off keeps one
    token too few, which a goodness-of-fit test over all classes may not see), or None."""
    n, drawn = len(draws), set(draws)
    for lv in _covered(levels, n):
        seen = sorted(drawn.intersection(lv.tokens))
        if lv.is_ambiguous and len(seen) < lv.kept:
            return (f"drew {len(seen)} distinct tokens {seen} of the tie {list(lv.tokens)} where {lv.kept} stay in "
                    f"{against} (each expected {n * lv.prob:.0f} times in {n} draws): a boundary one token off?")
        if not lv.is_ambiguous and len(seen) < len(lv.tokens):
            t = min(set(lv.tokens) - drawn)
            return (f"never drew token {t} in {n} draws although {against} keeps it with probability {lv.prob:.3g} "
                    f"(expected {n * lv.prob:.1f} times; a correct sampler misses it with probability "
                    f"{(1 - lv.prob) ** n:.1g}): a boundary one token off?")
    return None


def _own_reference(sampler: Sampler, logits: torch.Tensor, row: Row) -> RowReference:
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
    num = GREEDY_ROWS if sc.params.is_greedy else NUM_DRAWS
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
    problem = _unseen(draws, ref.levels, against)
    if problem:
        _fail(result, sc.feature, problem)
        return
    stat, dof, p = chi_square(draws, ref.levels)
    alpha = FAMILY_ALPHA / num_chi_square_tests()
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
