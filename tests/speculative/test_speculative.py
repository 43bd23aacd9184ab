"""Speculative decoding: the conformance tier on the built-in backends, planted bugs it must catch, the
acceptance rule's distribution, the built-in proposers, and the engine's refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.sdpa import SDPABackend
from kvcore.conformance import speculative_tier as tier
from kvcore.conformance.results import FAIL, PASS, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.speculative_proposers import ORACLE, RANDOM, REJECT_ALL, plugin
from kvcore.conformance.target import resolve_target
from kvcore.engine import verify
from kvcore.errors import ConfigError
from kvcore.interfaces.attention import BackendCapabilities
from kvcore.interfaces.proposer import Proposal
from kvcore.kernels.cpu_kernels import kernel_reasons
from kvcore.sampling.rejection import rejection_sample
from kvcore.scheduling.scheduler import Scheduler
from kvcore.speculative.backoff import FIRST_DRAFTS
from kvcore.speculative.draft import truncated
from kvcore.speculative.ngram import NgramProposer

CFG = SuiteConfig(dtype="float32", models=("tiny",), tiers=("speculative",))


def run_case(backend: str, proposer: str, variant: str) -> CaseResult:
    target = resolve_target(backend)
    case = tier.SpecCase(proposer, variant)
    result = CaseResult(tier="speculative", case=case.id, status=PASS)
    assert not tier.skip_reasons(target, case, CFG)
    tier.check(target, case, CFG, result)
    return result


@pytest.mark.parametrize("backend, proposer", [(b, RANDOM) for b in ("naive", "sdpa", "paged", "cpu_decode")]
                         + [("sdpa", ORACLE), ("paged", REJECT_ALL)])
def test_greedy_streams_unchanged(backend, proposer):
    if backend == "cpu_decode" and kernel_reasons():
        pytest.skip("; ".join(kernel_reasons()))
    result = run_case(backend, proposer, "greedy")
    assert result.status == PASS, result.detail


@pytest.mark.parametrize("proposer", [ORACLE, RANDOM])
def test_sampled_streams_unchanged(proposer):
    result = run_case("paged", proposer, "sampled")
    assert result.status == PASS, result.detail


@pytest.mark.slow
def test_rejection_rule_keeps_the_target_distribution_end_to_end():
    result = run_case("sdpa", RANDOM, "distribution")
    assert result.status == PASS, result.detail
    assert result.info["accepted_tokens"] > 0 and result.info["accepted_tokens"] < result.info["draft_tokens"]


def test_the_proposer_contract_is_public():
    import kvcore
    from kvcore.interfaces import proposer

    assert (kvcore.Proposer, kvcore.Proposal) == (proposer.Proposer, proposer.Proposal)
    assert {"Proposer", "Proposal"} <= set(kvcore.__all__)


# -- planted bugs ------------------------------------------------------------------------------------------
def test_planted_off_by_one_in_the_accepted_prefix_is_caught(monkeypatch):
    real = verify.num_matching
    monkeypatch.setattr(verify, "num_matching", lambda d, p: min(len(d), real(d, p) + 1))
    assert run_case("sdpa", REJECT_ALL, "greedy").status == FAIL


def test_planted_kv_not_rolled_back_is_caught(monkeypatch):
    monkeypatch.setattr(Scheduler, "roll_back", lambda self, reqs: None)
    assert run_case("paged", REJECT_ALL, "greedy").status == FAIL


def test_planted_bonus_token_dropped_is_caught(monkeypatch):
    real = verify.Verifier._verified

    def drop_bonus(self, logits, views, reqs, proposals):
        out = real(self, logits, views, reqs, proposals)
        return [t[:-1] if len(t) == len(p.token_ids) + 1 and p.token_ids else t for t, p in zip(out, proposals)]

    monkeypatch.setattr(verify.Verifier, "_verified", drop_bonus)
    result = run_case("sdpa", ORACLE, "greedy")
    assert result.status == FAIL and "bonus" in result.detail


# -- the rule itself -----------------------------------------------------------------------------------------
def test_rejection_sample_draws_from_p():
    """6000 seeded draws (fixed: deterministic) of one draft from q, verified against p: the emitted token
    follows p (chi-square, false-alarm rate 1e-3: limit 20.5 at 5 degrees of freedom)."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.1, 0.2, 0.2, 0.3]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q[0], 6000, replacement=True, generator=gen).tolist()
    counts = [0] * 6
    for seed, x in enumerate(drafts):
        kept, token = rejection_sample([x], p, q, seed, 0)
        counts[x if kept else token] += 1
    assert counts[5] == 0  # p(5) = 0: never emitted, although q proposes it most often
    chi2 = sum((c - 6000 * pi) ** 2 / (6000 * pi) for c, pi in zip(counts[:5], p[0].tolist()))
    assert chi2 < 20.5


def test_rejection_sample_detects_a_wrong_rule():
    """The same test catches the naive rule (keep every draft): the check above can fail."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.2, 0.3], dtype=torch.float64)
    counts = (q * 6000).tolist()  # what keeping every draft emits, on average
    chi2 = sum((c - 6000 * pi) ** 2 / (6000 * pi) for c, pi in zip(counts[:5], p.tolist()))
    assert chi2 > 20.5


# -- engine ----------------------------------------------------------------------------------------------
def test_backend_without_multi_token_decode_is_refused(random_model):
    class SingleToken(SDPABackend):
        name = "single-token"
        capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                           kv_layouts=("contiguous",))

    from helpers import make_plugin

    from kvcore.plugins.registry import PluginRegistry

    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(make_plugin(backends=[SingleToken]), "single")
    with pytest.raises(ConfigError, match="'single-token' does not declare multi-token decode"):
        Engine(random_model, None, EngineConfig(backend="single-token", proposer="ngram"), registry=reg)


def test_no_block_leak_and_max_tokens_with_prefix_caching(random_model):
    prompt = [5, 6, 7, 8, 9, 10, 11] * 4
    config = EngineConfig(backend="paged", proposer="draft", enable_prefix_caching=True, max_model_len=128,
                          dtype="float32", num_blocks=40, block_size=4)
    engine = Engine(random_model, None, config)
    free = engine.kv.blocks.num_free_blocks
    out = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14)])
    assert [len(r.token_ids) for r in out] == [9, 14]
    assert engine.kv.blocks.num_free_blocks == free and not engine.kv.blocks.seq_ids
    assert out[0].metrics.acceptance_rate == 1.0  # the draft is the target itself: every draft is kept
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens > 0


def test_draft_truncated_to_its_first_layers(random_model):
    draft = truncated(random_model, 1)
    assert draft.config.num_hidden_layers == 1 and random_model.config.num_hidden_layers == 2
    assert draft.embed_tokens is random_model.embed_tokens  # the weights are shared, not copied
    config = EngineConfig(backend="sdpa", proposer="draft", proposer_options={"draft": {"num_layers": 1}},
                          dtype="float32", max_model_len=96)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    got = Engine(random_model, None, config).generate([[3, 4, 5, 6]], params)[0]
    ref = Engine(random_model, None, EngineConfig(backend="sdpa", dtype="float32", max_model_len=96)).generate(
        [[3, 4, 5, 6]], params)[0]
    assert got.token_ids == ref.token_ids and got.metrics.num_draft_tokens > 0


def test_a_draft_model_is_loaded_in_the_weight_format_it_names(random_model):
    """``weights`` reaches the loader with the draft's ``model``; a draft model of float weights gets the dense head
    (None), not the target's; ``weights`` without ``model`` (the draft shares the target's weights) is refused."""
    from kvcore.interfaces.proposer import ProposerTarget
    from kvcore.speculative.draft import DraftModelProposer

    loads = []

    def load_model(spec, weights=None):
        loads.append((spec, weights))
        return random_model, None

    target = ProposerTarget(vocab_size=random_model.config.vocab_size, dtype=torch.float32,
                            device=torch.device("cpu"), max_model_len=64, max_num_seqs=2, model=random_model,
                            load_model=load_model, lm_head=object())
    proposer = DraftModelProposer(model="other.gguf", weights="int4a8")
    assert proposer.bind(target) == [] and loads == [("other.gguf", "int4a8")] and proposer.head is None
    shared = DraftModelProposer()
    assert shared.bind(target) == [] and shared.head is target.lm_head and shared.model is random_model
    with pytest.raises(ConfigError, match="weights sets the format of a draft model loaded with model"):
        Engine(random_model, None, EngineConfig(backend="sdpa", dtype="float32", proposer="draft",
                                                proposer_options={"draft": {"weights": "int4a8"}}))


class _Row:
    def __init__(self, tokens, request_id="r"):
        self.request_id, self.prompt_ids, self.output_ids = request_id, tokens, []


def test_ngram_proposes_the_latest_continuation_of_the_longest_match():
    proposer = NgramProposer(max_n=3, min_n=2)
    proposer.start("r", [])
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert proposer.propose([_Row(tokens)], [3])[0].token_ids == [5, 6, 1]  # the latest "1 2 3" came before 5
    longest = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]  # "2 3" came last before 8, "1 2 3" before 7
    assert proposer.propose([_Row(longest, "s")], [2])[0].token_ids == [7, 9]
    assert proposer.propose([_Row([7, 8, 9], "t")], [3])[0].token_ids == []  # nothing repeats: nothing proposed
    periodic = _Row([4, 1, 2, 3, 1, 2], "u")  # "1 2" last came 3 tokens back: the copy repeats its drafts
    proposer.start("u", [])
    proposer.advance("u", FIRST_DRAFTS, FIRST_DRAFTS)  # past a request's first proposal: as many drafts as asked
    assert proposer.propose([periodic], [5])[0].token_ids == [3, 1, 2, 3, 1]
    with pytest.raises(ConfigError, match="min_n"):
        NgramProposer(max_n=2, min_n=3)


def test_ngram_follows_the_copy_in_progress():
    """A copy that went on as proposed continues from its source, though its n-gram occurs later elsewhere."""
    proposer = NgramProposer(max_n=2, min_n=2)
    row = _Row([1, 2, 3, 4, 5, 6, 7, 9, 3, 4, 8, 0, 1, 2])
    assert proposer.propose([row], [1])[0].token_ids == [3]
    row.output_ids += [3, 4]  # the draft kept, then the target's own token: still the copy of 1 2 3 4 5 ...
    assert proposer.propose([row], [2])[0].token_ids == [5, 6]  # not [8, 0], after the later "3 4"
    row.output_ids += [5, 9]  # the copy broke off: the index again ("5 9" never came before)
    assert proposer.propose([row], [2])[0].token_ids == []
    fresh = NgramProposer(max_n=2, min_n=2)
    assert fresh.propose([_Row(row.prompt_ids[:14] + [3, 4])], [2])[0].token_ids == [8, 0]  # no copy to follow


def test_ngram_index_follows_the_stream_incrementally():
    proposer = NgramProposer(max_n=2, min_n=2)
    row = _Row([5, 6, 7, 8])
    assert proposer.propose([row], [2])[0].token_ids == []
    row.output_ids += [5, 6]  # "5 6" now repeats: what followed it in the prompt
    assert proposer.propose([row], [2])[0].token_ids == [7, 8]
    row.output_ids += [9, 7, 8]  # "7 8" last came before 5 (in the prompt), now it is the stream's own end
    assert proposer.propose([row], [3])[0].token_ids == [5, 6, 9]
    other = _Row([1, 2] * 5)  # a history that does not extend the indexed one is indexed anew
    assert proposer.propose([other], [2])[0].token_ids == [1, 2]


def test_ngram_adapts_the_number_of_drafts_within_the_budget():
    proposer = NgramProposer(max_n=2, min_n=2)
    row = _Row([1, 2] * 20)
    assert len(proposer.propose([row], [16])[0].token_ids) == FIRST_DRAFTS  # a request starts at FIRST_DRAFTS
    assert len(NgramProposer(max_n=2, min_n=2).propose([row], [2])[0].token_ids) == 2  # within the engine's K
    proposer.advance("r", FIRST_DRAFTS, FIRST_DRAFTS)  # all kept: twice as many next, never more than asked for
    assert len(proposer.propose([row], [16])[0].token_ids) == 2 * FIRST_DRAFTS
    assert len(proposer.propose([row], [5])[0].token_ids) == 5
    proposer.advance("r", 5, 2)  # a rejection: one more than were kept
    assert len(proposer.propose([row], [16])[0].token_ids) == 3


def test_ngram_backs_off_exponentially_and_probes_only_long_matches():
    proposer = NgramProposer(max_n=3, min_n=2, misses=2, cooldown=2)
    weak = _Row([4, 1, 2, 9, 8, 1, 2])  # only a 2-token match
    strong = _Row([4, 1, 2, 3, 9, 1, 2, 3], "s")  # a 3-token match
    for rid in ("r", "s"):
        proposer.start(rid, [])
        proposer.advance(rid, 4, 0)
        proposer.advance(rid, 1, 0)  # two misses in a row: back off for 2 steps
    assert proposer.propose([weak, strong], [4, 4]) == [Proposal(), Proposal()]
    assert proposer.propose([weak, strong], [4, 4]) == [Proposal(), Proposal()]
    weak_probe, strong_probe = proposer.propose([weak, strong], [4, 4])
    assert weak_probe.token_ids == [] and strong_probe.token_ids == [9]  # one draft, on a max_n match only
    proposer.advance("s", 1, 0)  # a failed probe backs off at once, twice as long
    assert all(proposer.propose([strong], [4])[0].token_ids == [] for _ in range(4))
    assert proposer.propose([strong], [4])[0].token_ids == [9]
    proposer.advance("s", 1, 1)  # a kept probe ends the back-off
    assert proposer.propose([strong], [4])[0].token_ids == [9, 1]
    with pytest.raises(ConfigError, match="misses"):
        NgramProposer(misses=0)


def test_draft_model_backs_off(random_model, monkeypatch):
    """Drafts that keep missing stop the draft model: after ``misses`` verifications it drafts nothing for
    ``cooldown`` steps (no draft forward), then probes with one draft; the stream is unchanged."""
    from kvcore.speculative.draft import DraftModelProposer

    real, asked = DraftModelProposer._drafts, []

    def wrong(self, rows, num_tokens):
        asked.append(list(num_tokens))
        return [Proposal([(t + 1) % random_model.config.vocab_size for t in p.token_ids])
                for p in real(self, rows, num_tokens)]

    monkeypatch.setattr(DraftModelProposer, "_drafts", wrong)
    options = {"draft": {"num_layers": 1, "misses": 2, "cooldown": 8}}
    config = EngineConfig(backend="sdpa", proposer="draft", num_speculative_tokens=3, dtype="float32",
                          max_model_len=96, proposer_options=options)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = Engine(random_model, None, config).generate([[3, 4, 5, 6]], params)[0]
    ref = Engine(random_model, None, EngineConfig(backend="sdpa", dtype="float32", max_model_len=96)).generate(
        [[3, 4, 5, 6]], params)[0]
    assert got.token_ids == ref.token_ids and got.metrics.num_accepted_tokens == 0
    # 3 drafts, then 1 (one more than kept): back off for 8 steps; a one-draft probe misses: 16 steps
    assert asked == [[3], [1], [1]] and got.metrics.num_spec_steps == 3
    with pytest.raises(ConfigError, match="cooldown"):
        DraftModelProposer(cooldown=0)


def test_backed_off_steps_are_plain_decode_steps(random_model, monkeypatch):
    """A stream whose lookups keep failing stops verifying: after the misses, the steps run the
    one-token decode forward, with no draft rows."""
    from kvcore.execution.runner import ModelRunner

    prompt = list(range(10, 40)) * 2
    config = EngineConfig(backend="sdpa", proposer="ngram", num_speculative_tokens=4, dtype="float32",
                          max_model_len=256, proposer_options={"ngram": {"misses": 2, "cooldown": 64}})
    engine = Engine(random_model, None, config)
    wrong = NgramProposer._lookup  # every draft a token that is not the next one: the drafts always miss

    def always_wrong(self, state, k, min_n):
        return [(t + 1) % random_model.config.vocab_size for t in wrong(self, state, k, min_n)[:1]] or [0]

    monkeypatch.setattr(NgramProposer, "_lookup", always_wrong)
    verifies, plain = [], []
    real_positions, real_forward = ModelRunner.forward_positions, ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward_positions",
                        lambda self, *a: verifies.append(a[5]) or real_positions(self, *a))
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, prefill, *a: plain.append((prefill, len(a[3]))) or real_forward(self, prefill, *a))
    got = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert len(got.token_ids) == 40
    assert got.metrics.num_spec_steps == 2 and got.metrics.num_accepted_tokens == 0  # then it backed off
    assert len(verifies) == 2
    assert all(ids == 1 for prefill, ids in plain if not prefill)  # the other steps: one token per row
    assert sum(not prefill for prefill, _ in plain) == 40 - 1 - 2


def test_a_step_without_drafts_runs_the_plain_decode_ops(random_model, monkeypatch):
    """With speculation configured, a decode step in which no request has drafts dispatches exactly the ops of
    the same step without speculation (no draft rows, no extra logits or copies), in the same order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    asked = []
    monkeypatch.setattr(NgramProposer, "_lookup", lambda self, state, k, min_n: asked.append(k) or [])
    prompt, config = list(range(10, 40)) * 2, dict(backend="sdpa", dtype="float32", max_model_len=128)
    steps = {}
    for name, extra in (("plain", {}), ("speculative", dict(proposer="ngram", num_speculative_tokens=4))):
        engine = Engine(random_model, None, EngineConfig(**config, **extra))
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        engine.step()  # prefill
        steps[name] = []
        for _ in range(4):
            with Ops() as ops:
                engine.step()
            steps[name].append(ops.names)
    assert asked == [4] * 4  # the proposer was asked every step and proposed nothing
    assert steps["speculative"] == steps["plain"] and all(steps["plain"])


def test_ngram_streams_unchanged_and_its_metrics(random_model):
    prompt = list(range(10, 40)) * 3
    config = EngineConfig(backend="sdpa", proposer="ngram", num_speculative_tokens=4, dtype="float32",
                          max_model_len=160)
    engine = Engine(random_model, None, config)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    ref = Engine(random_model, None, EngineConfig(backend="sdpa", dtype="float32", max_model_len=160)).generate(
        [prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert got.token_ids == ref.token_ids
    m = got.metrics.as_dict()
    assert m["draft_tokens"] == got.metrics.num_draft_tokens
    if got.metrics.num_spec_steps:
        assert 0 <= m["acceptance_rate"] <= 1
        assert math.isclose(m["mean_accepted_length"], got.metrics.num_accepted_tokens / got.metrics.num_spec_steps)
    else:
        assert m["acceptance_rate"] is None and m["mean_accepted_length"] is None
    # every decode step gives one token of the model's own, a verification also its kept drafts (no stop here)
    decode_steps = got.metrics.num_token_steps - 1
    assert decode_steps + got.metrics.num_accepted_tokens == len(got.token_ids) - 1
    assert math.isclose(m["tokens_per_step"], (len(got.token_ids) - 1) / decode_steps)
    assert ref.metrics.as_dict()["tokens_per_step"] == 1.0


def test_tokens_per_step_counts_the_steps_that_gave_tokens(random_model):
    """Drafts that are all kept (the true continuation) give K + 1 tokens a step: 20 tokens after the first in
    ceil(20 / 5) = 4 decode steps; without speculation one a step; one token has no decode step yet."""
    from kvcore.plugins.registry import PluginRegistry

    prompt, params = list(range(10, 40)), SamplingParams(max_new_tokens=21, ignore_eos=True)
    plain = EngineConfig(backend="sdpa", dtype="float32", max_model_len=160)
    truth = Engine(random_model, None, plain).generate([prompt], params)[0]
    assert truth.metrics.tokens_per_step == 1.0 and truth.metrics.num_token_steps == 21
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(plugin(), "conformance-proposers")
    oracle = dataclasses.replace(plain, proposer=ORACLE, num_speculative_tokens=4, proposer_options={
        ORACLE: {"continuations": {",".join(map(str, prompt)): truth.token_ids}}})
    got = Engine(random_model, None, oracle, registry=reg).generate([prompt], params)[0]
    assert got.token_ids == truth.token_ids
    assert got.metrics.num_token_steps == 1 + 4 and got.metrics.tokens_per_step == 20 / 4
    one = Engine(random_model, None, plain).generate([prompt], SamplingParams(max_new_tokens=1))[0]
    assert one.metrics.tokens_per_step is None


def test_speculation_settings_from_the_config_file(tmp_path):
    from kvcore.engine.settings import load_settings

    path = tmp_path / "k.toml"
    path.write_text('proposer = "ngram"\nnum_speculative_tokens = 6\n[proposers.ngram]\nmax_n = 5\n')
    s = load_settings(path)
    assert s.engine.proposer == "ngram" and s.engine.num_speculative_tokens == 6
    assert s.engine.proposer_options == {"ngram": {"max_n": 5}}
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
