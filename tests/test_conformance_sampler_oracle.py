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
from kvcore.conformance.sampler_oracle import check_oracle, chi_square
from kvcore.conformance.sampler_reference import Level, reference_row
from kvcore.conformance.sampler_scenarios import OracleCase, scenarios
from kvcore.conformance.settings import SuiteConfig
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.sampler import Sampler, SamplingParams
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
    yield from _registered(ArgmaxMinusOne, TokenZero, IgnoresMinP, SharedGenerator, OutputOnlyRepetition)


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
