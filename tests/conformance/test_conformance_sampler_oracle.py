"""The sampler oracle: kvcore's reference for each SamplingParams feature, the goodness-of-fit test, and
planted-bug samplers (registered as throwaway plugins) that `kvcore conformance --sampler NAME` must fail."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch

from kvcore.cli import main
from kvcore.conformance.results import PASS, CaseResult
from kvcore.conformance.sampler_oracle import COVERAGE_MIN_EXPECTED, check_oracle, chi_square, coverage_false_alarm
from kvcore.conformance.sampler_reference import Level, reference_row
from kvcore.conformance.sampler_scenarios import NUM_DRAWS, OracleCase, scenarios
from kvcore.conformance.settings import SuiteConfig
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.sampler import SAMPLING_FEATURES, Sampler, SamplingParams
from kvcore.plugins.registry import get_registry
from kvcore.sampling.sampler import DefaultSampler

SAMPLING_ONLY = ["--quick", "--tier", "sampling", "--model", "tiny", "--dtype", "float32", "--no-progress"]


class ArgmaxMinusOne(Sampler):
    name = "planted_argmax_minus_one"

    def sample(self, logits, rows):
        return (logits.argmax(-1) - 1) % logits.shape[-1]


class TokenZero(Sampler):
    name = "planted_token_zero"

    def sample(self, logits, rows):
        return torch.zeros(len(rows), dtype=torch.int64, device=logits.device)


class IgnoresMinP(DefaultSampler):
    name = "planted_ignores_min_p"

    def sample(self, logits, rows):
        return super().sample(logits, [_replace_params(r, min_p=0.0) for r in rows])


class SharedGenerator(DefaultSampler):
    """Right distribution, but one generator for the whole batch, seeded from its first row."""

    name = "planted_shared_generator"

    def sample(self, logits, rows):
        probs = self.logprobs(logits.clone(), rows).exp()
        g = torch.Generator(device=logits.device).manual_seed(rows[0].seed)
        drawn = torch.multinomial(probs, 1, generator=g)[:, 0]
        greedy = torch.tensor([r.params.is_greedy for r in rows], device=logits.device)
        return torch.where(greedy, super().sample(logits, rows), drawn)


class OutputOnlyRepetition(DefaultSampler):
    name = "planted_output_only_repetition"

    def sample(self, logits, rows):
        return super().sample(logits, [_Row(r.request_id, [], r.output_ids, r.params, r.seed) for r in rows])


def _filtered(logits, rows, top_k_shift=0, top_p_inclusive=False, min_p_strict=False):
    """DefaultSampler's temperature / top-k / top-p / min-p filter, with one boundary planted off by one."""
    vocab = logits.shape[-1]
    scores = logits.float() / torch.tensor([r.params.temperature for r in rows])[:, None]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    sorted_scores = sorted_scores.double()
    top_k = torch.tensor([(r.params.top_k or vocab) + (top_k_shift if r.params.top_k else 0) for r in rows])
    sorted_scores = sorted_scores.masked_fill(torch.arange(vocab)[None, :] >= top_k[:, None], -math.inf)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64)[:, None]
    probs = sorted_scores.softmax(-1)
    before = probs.cumsum(-1) - (0 if top_p_inclusive else probs)  # inclusive: the crossing token goes too
    sorted_scores = sorted_scores.masked_fill((before >= top_p) & (torch.arange(vocab) > 0), -math.inf)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float64)[:, None]
    probs = sorted_scores.softmax(-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    removed = (probs <= threshold) if min_p_strict else (probs < threshold)
    return sorted_scores.masked_fill(removed & (min_p > 0), -math.inf), order


class DrawsOnly(DefaultSampler):
    """The default sampler declaring no ``logprobs``: the oracle judges it by its draws alone."""

    name = "planted_draws_only"
    features = SAMPLING_FEATURES - {"logprobs"}

    def logprobs(self, logits, rows):
        raise AssertionError("the oracle asked a sampler that declares no logprobs for them")


class TopPInclusive(DrawsOnly):
    """Drops a token once the cumulative probability including it reaches top_p: the crossing token goes too."""

    name = "planted_top_p_inclusive"
    _filtered = staticmethod(lambda logits, rows: _filtered(logits, rows, top_p_inclusive=True))


class TopKMinusOne(DrawsOnly):
    name = "planted_top_k_minus_one"
    _filtered = staticmethod(lambda logits, rows: _filtered(logits, rows, top_k_shift=-1))


class TopKPlusOne(DrawsOnly):
    name = "planted_top_k_plus_one"
    _filtered = staticmethod(lambda logits, rows: _filtered(logits, rows, top_k_shift=1))


class MinPStrict(DrawsOnly):
    """Keeps a token only when its probability is strictly above min_p times the top one's."""

    name = "planted_min_p_strict"
    _filtered = staticmethod(lambda logits, rows: _filtered(logits, rows, min_p_strict=True))


class PlantedFilterUnchanged(DrawsOnly):
    """The test's copy of the filter with nothing planted: what the planted ones differ from by one boundary."""

    name = "planted_nothing"
    _filtered = staticmethod(lambda logits, rows: _filtered(logits, rows))


@dataclasses.dataclass
class _Row:
    request_id: str
    prompt_ids: list
    output_ids: list
    params: SamplingParams
    seed: int


def _replace_params(row, **changes):
    return _Row(row.request_id, row.prompt_ids, row.output_ids, dataclasses.replace(row.params, **changes), row.seed)


def _registered(*classes):
    plugin = types.ModuleType("throwaway_samplers")

    @hookimpl
    def kvcore_register_samplers(register):
        for cls in classes:
            register(cls)

    plugin.kvcore_register_samplers = kvcore_register_samplers
    registry = get_registry()
    name = registry.register_plugin(plugin, name="throwaway-samplers")
    try:
        yield
    finally:
        registry.unregister_plugin(name)


@pytest.fixture
def planted_samplers():
    yield from _registered(ArgmaxMinusOne, TokenZero, IgnoresMinP, SharedGenerator, OutputOnlyRepetition,
                           DrawsOnly, TopPInclusive, TopKMinusOne, TopKPlusOne, MinPStrict, PlantedFilterUnchanged)


@pytest.fixture
def example_sampler():
    example = pytest.importorskip("kvcore_example_backend.sampler")
    if "example_repetition_penalty" in get_registry().samplers:
        yield
    else:
        yield from _registered(example.RepetitionPenaltySampler)


@pytest.mark.parametrize("sampler, feature", [
    ("planted_argmax_minus_one", "greedy"),
    ("planted_token_zero", "greedy"),
    ("planted_ignores_min_p", "min_p"),
    ("planted_shared_generator", "seed"),
    ("planted_output_only_repetition", "repetition_penalty"),
])
def test_planted_sampler_fails_naming_the_feature(planted_samplers, capsys, sampler, feature):
    rc = main(["conformance", "--sampler", sampler, *SAMPLING_ONLY])
    out = capsys.readouterr().out
    assert rc == 1, out
    failures = [line for line in out.splitlines() if line.startswith("  sampler feature ")]
    assert failures and any(f"sampler feature {feature}" in line for line in failures), out


@pytest.mark.parametrize("sampler, cases", [
    # top_p 1 as well: the token that brings the sum to 1 goes (top_k-tie's last kept one)
    ("planted_top_p_inclusive", {"oracle-top_p", "oracle-top_p-boundary", "oracle-top_k-top_p", "oracle-top_k-tie"}),
    ("planted_top_k_minus_one", {"oracle-top_k", "oracle-top_k-tie"}),  # top_k-top_p's top_p cuts first
    ("planted_top_k_plus_one", {"oracle-top_k", "oracle-top_k-tie"}),
    ("planted_min_p_strict", {"oracle-min_p-1"}),
])
def test_boundary_one_token_off_is_caught_by_draws_alone(planted_samplers, capsys, sampler, cases):
    """Samplers that declare no logprobs, each with one filter boundary one token off (at ties too), fail exactly
    the scenarios whose boundary they move; the same filter with nothing planted passes every one."""
    rc = main(["conformance", "--sampler", sampler, *SAMPLING_ONLY, "--json"])
    report = json.loads(capsys.readouterr().out)
    failed = {r["case"]: r["detail"] for r in report["results"] if r["status"] == "fail"}
    assert rc == 1 and set(failed) == cases, failed
    assert all(d.startswith("sampler feature ") for d in failed.values()), failed


@pytest.mark.parametrize("sampler", ["planted_draws_only", "planted_nothing"])
def test_correct_samplers_without_logprobs_pass_by_their_draws(planted_samplers, capsys, sampler):
    rc = main(["conformance", "--sampler", sampler, *SAMPLING_ONLY, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, [r["detail"] for r in report["results"] if r["status"] == "fail"]


def test_coverage_checks_have_a_stated_false_alarm_rate():
    """Every kept token expected COVERAGE_MIN_EXPECTED times must be drawn: a correct sampler misses one of them in
    a run with probability under 1e-9 (the oracle's docstring and docs/conformance.md say so)."""
    total = sum(coverage_false_alarm(sc.reference().levels, NUM_DRAWS) for sc in scenarios() if not sc.params.is_greedy)
    assert 0 < total < 1e-9
    assert coverage_false_alarm([Level(0.0, (0,), 1, COVERAGE_MIN_EXPECTED / 100)], 100) == pytest.approx(
        (1 - COVERAGE_MIN_EXPECTED / 100) ** 100)


@pytest.mark.parametrize("sampler", ["default", "example_repetition_penalty"])
def test_correct_samplers_pass_the_oracle(example_sampler, capsys, sampler):
    rc = main(["conformance", "--sampler", sampler, *SAMPLING_ONLY, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, [r["detail"] for r in report["results"] if r["status"] == "fail"]
    oracle = [r for r in report["results"] if r["case"].startswith("oracle-")]
    assert len(oracle) == len(scenarios()) + 1 and all(r["status"] == "pass" for r in oracle)


def test_sampler_only_run_skips_the_tiers_that_do_not_judge_a_sampler(capsys):
    rc = main(["conformance", "--sampler", "default", "--quick", "--model", "tiny", "--dtype", "float32",
               "--no-progress", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    assert json.loads(captured.out)["tiers"].keys() == {"sampling"}
    assert "sampler only" in captured.err


def test_top_p_exactly_at_a_cumulative_boundary_keeps_three_of_four():
    logits = torch.tensor([0.0] * 4 + [-math.inf] * 4)
    ref = reference_row(logits, [], [], SamplingParams(temperature=1.0, top_p=0.75))
    assert [(lv.tokens, lv.kept, lv.prob) for lv in ref.levels] == [((0, 1, 2, 3), 3, 1 / 3)]
    # just above the boundary the fourth token stays
    ref = reference_row(logits, [], [], SamplingParams(temperature=1.0, top_p=0.76))
    assert ref.levels[0].kept == 4


def test_reference_penalises_prompt_and_output_and_breaks_ties_like_argmax():
    logits = torch.tensor([1.0, 4.0, 3.5, 3.0, -1.0])
    params = SamplingParams(repetition_penalty=2.0)
    assert reference_row(logits, [1], [2], params).greedy_token == 3  # 4/2 and 3.5/2 fall below 3
    assert reference_row(logits, [], [2], params).greedy_token == 1
    tie = torch.tensor([0.0, 2.0, 1.0, 2.0])
    assert reference_row(tie, [], [], SamplingParams()).greedy_token == int(tie.argmax())


def test_chi_square_rejects_a_wrong_distribution_and_pools_rare_classes():
    levels = [Level(0.0, (0,), 1, 0.5), Level(-1.0, (1,), 1, 0.3), Level(-2.0, (2, 3), 2, 0.1)]
    fair = [0] * 500 + [1] * 300 + [2] * 100 + [3] * 100
    stat, dof, p = chi_square(fair, levels)
    assert (stat, dof) == (0.0, 3) and p == pytest.approx(1.0)
    skewed = [0] * 600 + [1] * 200 + [2] * 100 + [3] * 100
    assert chi_square(skewed, levels)[2] < 1e-10
    rare = [Level(0.0, (0,), 1, 0.998), Level(-9.0, (1, 2), 2, 0.001)]  # expected 1 each in 1000: pooled
    assert chi_square([0] * 998 + [1, 2], rare)[1] == 0


def test_independence_check_catches_state_kept_across_calls():
    class Stateful(DefaultSampler):
        """Draws with seed + (number of earlier calls): right distribution, wrong reproducibility."""

        name = "planted_stateful"
        calls = 0

        def sample(self, logits, rows):
            shift, Stateful.calls = Stateful.calls, Stateful.calls + 1
            return super().sample(logits, [_Row(r.request_id, r.prompt_ids, r.output_ids, r.params, r.seed + shift)
                                           for r in rows])

    target = types.SimpleNamespace(make_sampler=Stateful)
    result = CaseResult("sampling", "oracle-independence", PASS)
    check_oracle(target, OracleCase("independence", index=len(scenarios())), SuiteConfig(), result)
    assert result.failed and "sampler feature seed" in result.detail
