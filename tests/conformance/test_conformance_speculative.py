"""The speculative tier over a lossy KV cache: logprobs held to what the cache's declared precision implies,
a lossless cache still held to float32 rounding; and the tier in the pytest base classes."""

from __future__ import annotations

import dataclasses
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers import make_plugin

from kvcore.conformance import speculative_tier as tier
from kvcore.conformance import tolerances
from kvcore.conformance.results import FAIL, PASS
from kvcore.conformance.runner import run_case
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.speculative_proposers import ORACLE, REJECT_ALL
from kvcore.conformance.target import resolve_target
from kvcore.engine import verify
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerCapabilities
from kvcore.plugins.registry import PluginRegistry, get_registry

try:
    from kvcore_example_backend.cache import Float16KVCache
except ImportError:  # the example package is not installed: use it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "kvcore-example-backend" / "src"))
    from kvcore_example_backend.cache import Float16KVCache

pytest_plugins = ["pytester"]

CFG = SuiteConfig(dtype="float32", models=("tiny",), tiers=("speculative",))
FP16_U = Float16KVCache.capabilities.unit_roundoff
SMALL = 3 * tolerances.SPECULATIVE_LOGPROB_ATOL  # over float32's tolerance, well inside float16 storage's


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _target(kv_cache: str):
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(make_plugin(kv_caches=[Float16KVCache]), "example-fp16")
    return resolve_target(None, reg, kv_cache=kv_cache)


def _run(kv_cache: str, proposer: str = ORACLE):
    return run_case(_target(kv_cache), "speculative", tier.SpecCase(proposer, "greedy"), CFG)


def test_logprob_tolerance_is_the_shared_lossy_rule():
    assert tolerances.logprob_tolerance() == tolerances.SPECULATIVE_LOGPROB_ATOL  # lossless: float32 only
    for u in (FP16_U, 1 / 254):
        want = tolerances.widened(tolerances.SPECULATIVE_LOGPROB_ATOL, tolerances.LOSSY_CACHE_FACTOR, u)
        assert tolerances.logprob_tolerance(u) == want == tolerances.LOSSY_CACHE_FACTOR * u
        assert tolerances.cache_tolerance(torch.float32, u).atol == tolerances.widened(
            tolerances.CACHE[torch.float32].atol, tolerances.LOSSY_CACHE_FACTOR, u)
    assert tolerances.SPECULATIVE_LOGPROB_ATOL < SMALL < tolerances.logprob_tolerance(FP16_U) / 10


@pytest.mark.parametrize("proposer", [ORACLE, REJECT_ALL])
def test_float16_cache_passes_held_to_its_unit_roundoff(proposer):
    """Verification rows and one-row decodes store K/V that differ by float32 rounding; float16 storage rounds
    the odd element to its neighbour, which later layers read: legitimate, and within the widened tolerance."""
    result = _run("example_fp16", proposer)
    assert result.status == PASS, result.describe()
    assert f"atol={tolerances.logprob_tolerance(FP16_U):g}" in result.tolerance
    assert result.max_err is not None and result.max_err <= tolerances.logprob_tolerance(FP16_U)


def _shift_logprobs(monkeypatch, delta: float) -> None:
    """Plant a bug: every logprob a verification emits is off by ``delta``."""
    real = verify.Verifier._verified

    def shifted(self, logits, views, reqs, proposals):
        rows = real(self, logits, views, reqs, proposals)
        return [[(t, None if lp is None else (lp[0] + delta, lp[1])) for t, lp in row] for row in rows]

    monkeypatch.setattr(verify.Verifier, "_verified", shifted)


@pytest.mark.parametrize("kv_cache, delta, caught", [
    ("paged", SMALL, True),  # a lossless cache: still float32's tolerance
    ("example_fp16", SMALL, False),  # the same shift is within float16 storage's rounding
    ("example_fp16", 2 * tolerances.LOSSY_CACHE_FACTOR * FP16_U, True),  # a lossy cache still catches a real error
], ids=["lossless-small", "float16-small", "float16-large"])
def test_planted_logprob_shift(monkeypatch, kv_cache, delta, caught):
    _shift_logprobs(monkeypatch, delta)
    result = _run(kv_cache)
    assert result.status == (FAIL if caught else PASS), result.describe()
    if caught:
        assert "logprobs differ from those without speculation" in result.detail
        assert result.max_err == pytest.approx(delta, rel=0.05)


def test_base_classes_run_the_speculative_tier(pytester):
    pytester.makepyfile(
        """
        import dataclasses

        import pytest

        from kvcore.backends.sdpa import SDPABackend
        from kvcore.conformance.base import BaseConformanceTests, BaseSpeculativeTests


        class SingleToken(SDPABackend):
            name = "single_token"
            capabilities = dataclasses.replace(SDPABackend.capabilities, multi_token_decode=False)


        class TestPaged(BaseConformanceTests):
            conformance_quick, conformance_models, conformance_dtype = True, ("tiny",), "float32"

            @pytest.fixture
            def backend(self):
                return "paged"


        class TestSingleToken(BaseSpeculativeTests):
            conformance_models, conformance_dtype = ("tiny",), "float32"

            @pytest.fixture
            def backend(self):
                return SingleToken
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-k", "test_speculative and greedy")
    result.assert_outcomes(passed=3, skipped=3)  # oracle, reject-all and random, each on both classes
    result.stdout.fnmatch_lines(["*does not declare multi-token decode*"])


def test_plugin_option_certifies_a_proposer_on_the_speculative_tier_only(pytester):
    result = pytester.runpytest("--kvcore-proposer", "ngram", "--kvcore-quick", "--kvcore-model", "tiny",
                                "-p", "no:cacheprovider", "-v", "-rs")
    outcomes = result.parseoutcomes()
    # skipped: ngram-distribution (its drafts are deterministic: its sampled streams are compared instead)
    assert outcomes.get("passed", 0) >= 3 and outcomes.get("skipped") == 1 and set(outcomes) == {"passed", "skipped"}
    result.stdout.fnmatch_lines(["*deterministic proposer's sampled streams are compared token for token*"])
    lines = [line for line in result.outlines if " PASSED" in line]
    assert len(lines) == outcomes["passed"] and all("::test_speculative[" in line for line in lines)
    result.stdout.fnmatch_lines(["*kvcore conformance: proposer ngram (quick)*",
                                 "*test_speculative[[]proposer=ngram-ngram-greedy[]] PASSED*",
                                 "*test_speculative[[]proposer=ngram-ngram-sampled[]] PASSED*"])


def test_base_classes_certify_a_proposer_and_fail_a_broken_one(pytester):
    """``conformance_proposer`` adds the proposer's cases; one whose drafts are not token ids fails them."""
    pytester.makepyfile(
        """
        import pytest

        from kvcore import hookimpl
        from kvcore.conformance.base import BaseSpeculativeTests
        from kvcore.interfaces.proposer import Proposal, Proposer
        from kvcore.plugins.registry import get_registry


        class RepeatLast(Proposer):
            name = "repeat_last"

            def propose(self, rows, num_tokens):
                return [Proposal([(r.prompt_ids + r.output_ids)[-1]] * k) for r, k in zip(rows, num_tokens)]


        class OutOfVocabulary(Proposer):
            name = "out_of_vocabulary"

            def propose(self, rows, num_tokens):
                return [Proposal([10 ** 9] * k) for k in num_tokens]


        class Plugin:
            @hookimpl
            def kvcore_register_proposers(self, register):
                register(RepeatLast)
                register(OutOfVocabulary)


        get_registry().register_plugin(Plugin(), name="test-proposers")


        class TestRepeatLast(BaseSpeculativeTests):
            conformance_models, conformance_dtype, conformance_quick = ("tiny",), "float32", True
            conformance_proposer = "repeat_last"

            @pytest.fixture
            def backend(self):
                return "sdpa"


        class TestOutOfVocabulary(TestRepeatLast):
            conformance_proposer = "out_of_vocabulary"
        """
    )
    try:
        result = pytester.runpytest("-p", "no:cacheprovider", "-v", "-k",
                                    "repeat_last-greedy or out_of_vocabulary-greedy")
    finally:  # the run is in this process: its registration must not outlive it
        get_registry().unregister_plugin("test-proposers")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*TestRepeatLast::test_speculative[[]TestRepeatLast-repeat_last-greedy[]] PASSED*",
                                 "*TestOutOfVocabulary::test_speculative[[]TestOutOfVocabulary-out_of_vocabulary-greedy[]]"
                                 " FAILED*"])


class SampledQ(Proposer):
    """Drafts drawn at the request's temperature from random scores, reporting the ``q`` they were drawn from."""

    name = "planted_sampled_q"
    capabilities = ProposerCapabilities(deterministic=False)

    def bind(self, target):
        self.vocab_size = target.vocab_size
        return []

    def reported(self, scores, temperature):
        return (scores / temperature).softmax(-1)

    def propose(self, rows, num_tokens):
        out = []
        for row, k in zip(rows, num_tokens):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{row.request_id}|{len(row.output_ids)}".encode()))
            scores = torch.randn(k, self.vocab_size, generator=gen, dtype=torch.float64) * 2
            temperature = row.params.temperature or 1.0  # greedy requests: any q will do
            ids = torch.multinomial((scores / temperature).softmax(-1), 1, generator=gen)[:, 0].tolist()
            out.append(Proposal(ids, self.reported(scores, temperature)))
        return out


class QAtTemperatureOne(SampledQ):
    """Draws at the request's temperature but reports ``q`` at temperature 1."""

    name = "planted_q_at_temperature_one"

    def reported(self, scores, temperature):
        return scores.softmax(-1)


class DropsWindows(Proposer):
    """Turns the target's sliding windows off when it binds (a draft that wants whole-sequence attention)."""

    name = "planted_drops_windows"

    def bind(self, target):
        layers = target.model.attention_layers
        target.model.attention_layers = tuple(dataclasses.replace(a, sliding_window=None) for a in layers)
        return []

    def propose(self, rows, num_tokens):
        return [Proposal([(r.prompt_ids + r.output_ids)[-1]] * k) for r, k in zip(rows, num_tokens)]


class ScalesANorm(DropsWindows):
    """Scales the target's final norm in place when it binds."""

    name = "planted_scales_a_norm"

    def bind(self, target):
        target.model.norm.data.mul_(1.5)
        return []


def _proposer_cases(proposer: type) -> dict:
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(make_plugin(proposers=[proposer]), "planted-proposer")
    target = resolve_target("sdpa", reg, proposer=proposer.name)
    cases = [c for c in tier.cases(target, CFG) if c.proposer == proposer.name]
    return {c.variant: run_case(target, "speculative", c, CFG) for c in cases}


def test_a_draft_q_that_is_not_what_the_drafts_were_drawn_from_is_caught():
    """At the distribution case's temperature (not 1), drafts drawn at the request's temperature must come with
    that q: the same proposer reporting q at temperature 1 fails, naming the reported q."""
    good = _proposer_cases(SampledQ)["distribution"]
    assert good.status == PASS and "fit their reported q" in good.detail, good.describe()
    bad = _proposer_cases(QAtTemperatureOne)["distribution"]
    assert bad.status == FAIL and "not drawn from the q it reports" in bad.detail, bad.describe()


def test_a_proposer_that_changes_the_target_model_is_caught():
    """Dropping the target's windows changes nothing on the plain tiny model (its cases pass) and fails the
    variants case on tiny-local; scaling a weight fails at once. The model is as made again for later cases."""
    windows = _proposer_cases(DropsWindows)
    assert windows["greedy"].status == PASS and windows["sampled"].status == PASS
    variants = windows["variants"]
    assert variants.status == FAIL, variants.describe()
    assert "changed the target model: layer 0's attention sliding window changed from" in variants.detail
    norm = _proposer_cases(ScalesANorm)["greedy"]
    assert norm.status == FAIL and "the model's weight 'norm' changed" in norm.detail, norm.describe()
    assert _proposer_cases(SampledQ)["variants"].status == PASS  # the cached models were made again
