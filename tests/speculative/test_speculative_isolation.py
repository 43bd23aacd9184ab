"""Speculation and the request lifecycle: a proposer's mistakes stay with the request they concern, its
lifecycle calls come in order, sequence limits hold with n > 1, and the counters count what was emitted."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_plugin

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.conformance import speculative_tier as tier
from kvcore.conformance.models import get_model
from kvcore.conformance.results import FAIL, PASS, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target
from kvcore.errors import ContextLengthError, PluginError
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerCapabilities
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.scheduler import Scheduler

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11]]


def registry_with(*proposers) -> PluginRegistry:
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(make_plugin(proposers=list(proposers)), "test-proposers")
    return reg


def engine(model, proposer=None, registry=None, **config) -> Engine:
    config = {"backend": "sdpa", "dtype": "float32", "max_model_len": 64, "num_speculative_tokens": 3, **config}
    return Engine(model, None, EngineConfig(proposer=proposer, **config), registry=registry)


def reference(model, prompts, params):
    return [r.token_ids for r in engine(model).generate(prompts, params)]


def test_admission_counts_the_samples_an_admitted_request_will_fork(random_model, monkeypatch):
    """An n = 2 request admitted first occupies two sequences: the request behind it waits, so that no step
    runs more than max_num_seqs (the draft model's cache has exactly that many)."""
    peak = [0]
    schedule = Scheduler.schedule

    def spy(self):
        out = schedule(self)
        peak[0] = max(peak[0], len(self.running))
        return out

    monkeypatch.setattr(Scheduler, "schedule", spy)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, n=2, temperature=0.7, seed=3),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    for backend, proposer in (("paged", None), ("paged", "draft"), ("sdpa", "draft")):
        peak[0] = 0
        out = engine(random_model, proposer, backend=backend, max_num_seqs=2).generate(PROMPTS[:2], params)
        assert [r.error for r in out] == [None] * 3 and [len(r.token_ids) for r in out] == [12] * 3
        assert peak[0] == 2, (backend, proposer)


def oracle(truth: dict[tuple[int, ...], list[int]], log: list) -> type[Proposer]:
    """Proposes each prompt's true continuation; keeps per-request state from start to finish, as a plugin
    may, and logs its lifecycle calls."""

    class Oracle(Proposer):
        name = "lifecycle-oracle"

        def __init__(self):
            super().__init__()
            self.state: dict[str, tuple[int, ...]] = {}

        def start(self, request_id, token_ids):
            log.append(("start", request_id))
            self.state[request_id] = tuple(token_ids)

        def finish(self, request_id):
            log.append(("finish", request_id))
            del self.state[request_id]

        def advance(self, request_id, num_proposed, num_accepted):
            log.append(("advance", request_id))
            self.state[request_id]  # noqa: B018 - a KeyError if the engine advances a finished request

        def propose(self, rows, num_tokens):
            return [Proposal(truth[tuple(r.prompt_ids)][len(r.output_ids):][:k]) for r, k in zip(rows, num_tokens)]

    return Oracle


def test_a_request_ending_inside_its_drafts_is_not_advanced_after_finish(random_model):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    truth = {tuple(p): t for p, t in zip(PROMPTS, reference(random_model, PROMPTS, SamplingParams(
        max_new_tokens=9, ignore_eos=True)))}
    log = []
    reg = registry_with(oracle(truth, log))
    out = engine(random_model, "lifecycle-oracle", reg, num_speculative_tokens=4).generate(PROMPTS, params)
    assert [r.token_ids for r in out] == [t[:6] for t in truth.values()]
    for rid in {r for _, r in log}:
        calls = [c for c, r in log if r == rid]
        assert calls[0] == "start" and calls[-1] == "finish" and calls.count("finish") == 1, calls
    assert sum(r.metrics.num_accepted_tokens for r in out) > 0


def test_the_draft_proposer_holds_no_state_after_its_requests(random_model):
    eng = engine(random_model, "draft", num_speculative_tokens=4)
    for i in range(3):
        eng.generate([[3, 4, 5, 6 + i]], SamplingParams(max_new_tokens=9, ignore_eos=True))
    proposer = eng.speculator.proposer
    assert not proposer._lengths and not proposer._seqs


def test_a_preempted_request_is_finished_and_started_again(random_model):
    """Its proposer state is not held while it waits (a draft model's cache rows), and it resumes its stream."""
    log = []
    prompts, params = [[3, 4, 5, 6]] * 2, SamplingParams(max_new_tokens=20, ignore_eos=True)
    truth = {tuple(prompts[0]): reference(random_model, prompts[:1], params)[0]}
    eng = engine(random_model, "lifecycle-oracle", registry_with(oracle(truth, log)), backend="paged",
                 max_num_seqs=2, block_size=4, num_blocks=9)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == [truth[tuple(prompts[0])]] * 2
    assert eng.stats.num_preemptions > 0
    restarted = 0
    for rid in {r for _, r in log}:
        calls = [c for c, r in log if r == rid and c != "advance"]
        assert calls == ["start", "finish"] * (len(calls) // 2), calls  # never started twice without a finish
        restarted += len(calls) > 2
    assert restarted > 0

V = 300  # random_model's vocabulary
BAD = {
    "out-of-vocabulary": lambda k: Proposal([V + 5]),
    "negative": lambda k: Proposal([-1]),
    "too-many": lambda k: Proposal([1] * (k + 1)),
    "ids-none": lambda k: Proposal(None),
    "ids-int": lambda k: Proposal(7),
    "ids-bool": lambda k: Proposal([True]),
    "probs-list": lambda k: Proposal([1], [[1.0 / V] * V]),
    "probs-shape": lambda k: Proposal([1], torch.full((2, V), 1.0 / V)),
    "probs-nan": lambda k: Proposal([1], torch.full((1, V), float("nan"))),
    "probs-negative": lambda k: Proposal([1], torch.full((1, V), -1.0)),
    "probs-logprobs": lambda k: Proposal([1], torch.full((1, V), math.log(1 / V))),
    "huge": lambda k: Proposal([1] * 100_000),
    "ids-tensor": lambda k: Proposal(torch.ones(1, dtype=torch.long)),
    "ids-float": lambda k: Proposal([1.0]),
}
#: what each refusal says, beyond the proposer's name
REASON = {"out-of-vocabulary": "not a token id of the vocabulary [0, 300)", "negative": "draft 0 = -1, not a token id",
          "too-many": "where at most", "huge": "proposed 100000 drafts", "ids-none": "returned token_ids of NoneType",
          "ids-int": "returned token_ids of int", "ids-tensor": "returned token_ids of Tensor",
          "ids-float": "draft 0 = 1.0, not a token id", "ids-bool": "draft 0 = True, not a token id"}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_malformed_proposal_fails_only_its_request(random_model, kind):
    class Bad(Proposer):
        name = "bad"
        capabilities = ProposerCapabilities(deterministic=False)

        def propose(self, rows, num_tokens):
            return [BAD[kind](k) if r.request_id == "req-1" else Proposal() for r, k in zip(rows, num_tokens)]

    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    out = engine(random_model, "bad", registry_with(Bad)).generate(PROMPTS, params)
    assert random_model.config.vocab_size == V
    assert isinstance(out[1].error, PluginError) and "proposer 'bad'" in str(out[1].error)
    assert REASON.get(kind, "") in str(out[1].error)
    ref = reference(random_model, PROMPTS, params)
    assert [out[0].token_ids, out[2].token_ids] == [ref[0], ref[2]] and out[0].error is out[2].error is None


def test_a_proposer_failing_in_advance_fails_only_its_request(random_model):
    class Flaky(Proposer):
        name = "flaky"

        def propose(self, rows, num_tokens):
            return [Proposal([1][:k]) for k in num_tokens]

        def advance(self, request_id, num_proposed, num_accepted):
            if request_id == "req-1":
                raise RuntimeError("lost its state")

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = engine(random_model, "flaky", registry_with(Flaky)).generate(PROMPTS, params)
    assert "failed in advance: RuntimeError: lost its state" in str(out[1].error)
    ref = reference(random_model, PROMPTS, params)
    assert [out[0].token_ids, out[2].token_ids] == [ref[0], ref[2]]


def test_accepted_drafts_count_only_the_tokens_emitted(random_model):
    """A stop token inside the kept drafts ends the stream there: the drafts after it were never emitted."""
    ref = reference(random_model, PROMPTS[:1], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = ref[2]
    assert stop not in ref[:2]
    eng = engine(random_model, "draft", num_speculative_tokens=6)
    out = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))[0]
    assert out.token_ids == ref[:3]
    assert out.metrics.num_accepted_tokens == eng.stats.num_accepted_tokens == 2  # the tokens after the first


def test_the_distribution_case_certifies_a_sampling_proposer_and_fails_a_wrong_q():
    """A proposer that samples its drafts gets a chi-square case of its own; one that proposes the target's
    likeliest token while it reports a uniform q (so the rule keeps it every time) fails it."""
    cm = get_model(tier.MODEL, torch.float32, "cpu")
    prompt, base = list(cm.prompts[1]), {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    likeliest = {}
    plain = Engine(cm.model, None, EngineConfig(backend="sdpa", dtype="float32", max_model_len=len(prompt) + 8))
    for first in tier._top(plain, prompt, base):
        second = tier._top(plain, prompt + [first], base)
        likeliest[(*prompt, first)] = max(second, key=second.get)

    class Biased(Proposer):
        name = "biased-q"
        capabilities = ProposerCapabilities(deterministic=False)

        def bind(self, target):
            self.vocab = target.vocab_size
            return []

        def propose(self, rows, num_tokens):
            out = []
            for row, k in zip(rows, num_tokens):
                token = likeliest.get((*row.prompt_ids, *row.output_ids))
                ids = [token] if token is not None and k else []
                out.append(Proposal(ids, torch.full((len(ids), self.vocab), 1.0 / self.vocab) if ids else None))
            return out

    reg = PluginRegistry()
    name = reg.register_plugin(make_plugin(proposers=[Biased]), "biased")
    try:
        target = resolve_target("sdpa", registry=reg, proposer="biased-q")
        cfg = SuiteConfig(dtype="float32", models=("tiny",), tiers=("speculative",))
        ids = [c.id for c in tier.cases(target, cfg)]
        assert "biased-q-distribution" in ids and "random-distribution" in ids
        result = CaseResult(tier="speculative", case="biased-q-distribution", status=PASS)
        tier.check(target, tier.SpecCase("biased-q", "distribution"), cfg, result)
        assert result.status == FAIL and "do not follow the target distribution" in result.detail, result.detail
    finally:
        reg.unregister_plugin(name)


def run_bounded(eng: Engine, prompts, params, max_steps: int = 200) -> list:
    """``eng.generate`` that gives up after ``max_steps`` steps (a hang fails the test instead of CI)."""
    ids = [eng.add_request(p, params) for p in prompts]
    steps = 0
    while eng.has_unfinished() and steps < max_steps:
        eng.step()
        steps += 1
    assert not eng.has_unfinished(), f"the engine still runs after {steps} steps: it loops"
    return [eng.result(r) for r in ids]


def test_a_proposer_that_ignores_the_budget_fails_its_requests_with_the_reason(random_model):
    """K drafts whatever the request may still take: the last steps of every stream refuse them (the contract
    is at most ``num_tokens``; a proposer that overruns it has a bug for the suite to show, not to hide)."""

    class AlwaysK(Proposer):
        name = "always-k"

        def propose(self, rows, num_tokens):
            return [Proposal([1] * 3) for _ in rows]

    out = run_bounded(engine(random_model, "always-k", registry_with(AlwaysK)), PROMPTS,
                      SamplingParams(max_new_tokens=6, ignore_eos=True))
    for r in out:
        assert isinstance(r.error, PluginError), r.error
        assert "proposer 'always-k' proposed 3 drafts [1, 1, 1] where at most 2 were asked for" in str(r.error)
        assert len(r.token_ids) < 6


@pytest.mark.parametrize("grown", ["output_ids", "prompt_ids", "replaced"])
def test_a_proposer_that_writes_into_its_rows_fails_its_request_and_never_hangs(random_model, grown):
    """Drafts appended to the requests themselves grew them past max_new_tokens and the context: the scheduler
    then preempted and recomputed the two of them in turn, forever. Now their tokens are put back and they fail;
    the other request runs on."""

    class Writer(Proposer):
        name = "writer"

        def propose(self, rows, num_tokens):
            for r in rows:
                if r.request_id != "req-0":
                    if grown == "replaced":
                        r.output_ids = r.output_ids + [1] * 100
                    else:
                        getattr(r, grown).extend([1] * 100)
            return [Proposal() for _ in rows]

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = run_bounded(engine(random_model, "writer", registry_with(Writer)), PROMPTS, params)
    ref = reference(random_model, PROMPTS, params)
    for i in (1, 2):
        error = out[i].error
        assert isinstance(error, PluginError) and f"proposer 'writer' changed request 'req-{i}'" in str(error), error
        assert "read only" in str(error)
        assert out[i].prompt_token_ids == PROMPTS[i] and out[i].token_ids == ref[i][: len(out[i].token_ids)]
    assert out[0].token_ids == ref[0] and out[0].error is None


def test_a_request_grown_past_the_context_later_fails_instead_of_looping(random_model):
    """A proposer that keeps its rows and writes into one outside ``propose`` (here in ``advance``): the
    scheduler refuses to run a sequence past the context limit again."""

    class Late(Proposer):
        name = "late-writer"

        def __init__(self):
            super().__init__()
            self.rows = {}

        def propose(self, rows, num_tokens):
            self.rows.update((r.request_id, r) for r in rows)
            return [Proposal([1][:k]) for k in num_tokens]

        def advance(self, request_id, num_proposed, num_accepted):
            if request_id != "req-0":
                self.rows[request_id].output_ids.extend([1] * 100)

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = run_bounded(engine(random_model, "late-writer", registry_with(Late)), PROMPTS, params)
    for i in (1, 2):
        assert isinstance(out[i].error, ContextLengthError), out[i].error
        assert f"request 'req-{i}' holds" in str(out[i].error) and "past the context limit of 64" in str(out[i].error)
    ref = reference(random_model, PROMPTS, params)
    assert out[0].token_ids == ref[0] and out[0].error is None


@pytest.mark.parametrize("returned", ["lists", "too-few", "dict", "raises"])
def test_a_malformed_return_fails_the_rows_of_that_call_naming_the_proposer(random_model, returned):
    class Broken(Proposer):
        name = "broken"

        def propose(self, rows, num_tokens):
            if returned == "raises":
                raise RuntimeError("lost")
            got = {"lists": [[1] for _ in rows], "too-few": [Proposal()] * (len(rows) - 1),
                   "dict": {r.request_id: Proposal() for r in rows}}
            return got[returned]

    out = run_bounded(engine(random_model, "broken", registry_with(Broken)), PROMPTS,
                      SamplingParams(max_new_tokens=8, ignore_eos=True))
    expected = "failed: RuntimeError: lost" if returned == "raises" else "must return one Proposal per row (3), got "
    for r in out:
        assert isinstance(r.error, PluginError) and f"proposer 'broken' {expected}" in str(r.error), r.error
