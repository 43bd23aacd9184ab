"""The OpenAI / vLLM sampling parameters of the default sampler, each against an independent oracle:
transformers' logits processors (repetition penalty, temperature / top-k / top-p / min-p), or the
documented OpenAI formulas written out element by element (presence / frequency penalties, logit bias);
validation; logprobs; seeded streams."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Row
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvcore import SamplingParams
from kvcore.errors import InvalidRequestError
from kvcore.sampling.processors import apply_penalties
from kvcore.sampling.sampler import DefaultSampler, sample_checked

V = 300


def random_logits(rows: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * spread


def random_ids(n: int, seed: int, high: int = 40) -> list[int]:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(n=0), "n must be"),
        (dict(n=True), "n must be"),
        (dict(stop=[""]), "stop must be"),
        (dict(stop=[1]), "stop must be"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_window=0), "repetition_window"),
        (dict(repetition_window=True), "repetition_window"),
        (dict(repetition_window=2.5), "repetition_window"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(logit_bias={-1: 1.0}), "token id"),
        (dict(logit_bias={"x": 1.0}), "token id"),
        (dict(logit_bias={5: 100.5}), "[-100, 100]"),
        (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "twice"),
        (dict(logit_bias=3), "logit_bias"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
    ],
)
def test_invalid_values_are_one_clear_error(kw, fragment):
    with pytest.raises(InvalidRequestError, match=None) as err:
        SamplingParams(**kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_params_are_frozen_and_hashable():
    p = SamplingParams(stop="###", logit_bias={"7": -5, 3: 2.5}, logprobs=0, n=3)
    assert p.stop == ("###",) and p.logit_bias == ((3, 2.5), (7, -5.0))
    assert hash(p) == hash(SamplingParams(stop=("###",), logit_bias=[(7, -5), (3, 2.5)], logprobs=0, n=3))
    with pytest.raises(AttributeError):
        p.n = 2  # type: ignore[misc]


# -- penalties and bias ----------------------------------------------------------------------------------
def test_repetition_penalty_matches_transformers():
    logits = random_logits(5, seed=0)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1]
    rows = [Row(SamplingParams(repetition_penalty=p), prompt_ids=random_ids(12, i), output_ids=random_ids(7, 50 + i))
            for i, p in enumerate(penalties)]
    got = logits.clone()
    apply_penalties(got, rows)
    for i, (row, p) in enumerate(zip(rows, penalties)):
        ids = torch.tensor([row.prompt_ids + row.output_ids])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 5, 7, 12, 19, 40])
def test_repetition_window_penalises_the_last_tokens_only(window):
    """The window covers output first, then reaches back into the prompt (Ollama's ``repeat_last_n``): the same as
    transformers' processor over the last ``window`` ids of prompt + output."""
    logits = random_logits(1, seed=3)
    row = Row(SamplingParams(repetition_penalty=1.7, repetition_window=window), prompt_ids=random_ids(12, 4),
              output_ids=random_ids(7, 54))
    got = logits.clone()
    apply_penalties(got, [row])
    ids = torch.tensor([(row.prompt_ids + row.output_ids)[-window:]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())[0]
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


def test_presence_frequency_and_bias_follow_the_openai_formulas():
    logits = random_logits(4, seed=1)
    cases = [
        dict(presence_penalty=0.5),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=-1.0, frequency_penalty=0.25, logit_bias={3: 100, 7: -100, 299: 0.5}),
        dict(logit_bias={0: -3.0}, repetition_penalty=1.5),
    ]
    rows = [Row(SamplingParams(**kw), prompt_ids=random_ids(5, 9 + i), output_ids=random_ids(20, i, high=10))
            for i, kw in enumerate(cases)]
    got = logits.clone()
    apply_penalties(got, rows)
    for i, row in enumerate(rows):  # the documented formulas, one token at a time
        p, want = row.params, logits[i].clone()
        for token, bias in p.logit_bias:
            want[token] += bias
        for token in set(row.prompt_ids + row.output_ids):
            x = want[token]
            want[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(row.output_ids):
            count = row.output_ids.count(token)
            want[token] -= p.frequency_penalty * count + p.presence_penalty
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)


def test_penalties_apply_to_greedy_rows_and_leave_other_rows_alone():
    logits = random_logits(3, seed=2)
    top = logits.argmax(-1)
    rows = [Row(SamplingParams()), Row(SamplingParams(logit_bias={int(top[1]): -100})), Row(SamplingParams())]
    got = DefaultSampler().sample(logits.clone(), rows)
    assert got[0] == top[0] and got[2] == top[2]
    assert got[1] != top[1]
    boosted = [Row(SamplingParams(logit_bias={17: 100}))]
    assert DefaultSampler().sample(logits[:1].clone(), boosted).tolist() == [17]


# -- truncation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.05), (1.3, 40, 0.9, 0.02), (0.5, 0, 0.8, 0.3), (1.0, 5, 1.0, 0.0)],
)
def test_processed_distribution_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    logits = random_logits(8, seed=3, spread=2.0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = DefaultSampler().logprobs(logits.clone(), [Row(params)] * 8)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    want = logits.clone()
    for w in warpers:  # transformers' order: temperature, top-k, top-p, min-p
        want = w(torch.zeros(8, 1, dtype=torch.long), want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(want)
    torch.testing.assert_close(got[kept], want.log_softmax(-1)[kept], rtol=1e-5, atol=1e-5)
    assert bool((kept.sum(-1) < V).any()) or not (top_k or top_p < 1 or min_p)  # the filters did cut


def test_min_p_draws_stay_in_the_kept_set():
    logits = random_logits(1, seed=4, spread=4.0)
    params = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    probs = logits.softmax(-1)[0]
    allowed = set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())
    rows = [Row(params, seed=s) for s in range(400)]
    drawn = set(DefaultSampler().sample(logits.expand(400, V).clone(), rows).tolist())
    assert drawn <= allowed and len(drawn) > 1


# -- logprobs --------------------------------------------------------------------------------------------
def test_logprobs_are_the_chosen_tokens_and_the_top_alternatives():
    logits = random_logits(3, seed=5)
    rows = [
        Row(SamplingParams(logprobs=3)),  # greedy
        Row(SamplingParams(temperature=0.8, top_k=2, logprobs=5, seed=1), seed=1),  # only 2 tokens survive
        Row(SamplingParams()),  # no logprobs asked
    ]
    ids, lps = sample_checked(DefaultSampler(), logits.clone(), rows)
    assert lps[2] is None
    chosen, top = lps[0]
    full = logits[0].log_softmax(-1)
    assert ids[0] == int(full.argmax()) and math.isclose(chosen, float(full[ids[0]]), rel_tol=1e-6)
    assert [t for t, _ in top] == full.topk(3).indices.tolist()
    chosen, top = lps[1]
    kept = (logits[1] / 0.8).topk(2)
    want = kept.values.log_softmax(-1)
    assert [t for t, _ in top] == kept.indices.tolist()  # removed tokens are not offered as alternatives
    torch.testing.assert_close(torch.tensor([v for _, v in top]), want, rtol=1e-5, atol=1e-6)
    assert ids[1] in kept.indices.tolist() and chosen == dict(top)[ids[1]]


def test_zero_logprobs_gives_only_the_chosen_token():
    ids, lps = sample_checked(DefaultSampler(), random_logits(1, seed=6), [Row(SamplingParams(logprobs=0))])
    assert lps[0][1] == [] and lps[0][0] <= 0.0


# -- seeded streams --------------------------------------------------------------------------------------
def _stream(params: SamplingParams, seed: int, others: int, steps: int = 12) -> list[int]:
    """Decode ``steps`` tokens of one seeded row from history-dependent synthetic logits, batched with
    ``others`` unrelated rows."""
    row = Row(params, seed=seed, prompt_ids=[4, 5, 6])
    noise = [Row(SamplingParams(temperature=1.0, seed=s), seed=s) for s in range(others)]
    for _ in range(steps):
        base = random_logits(1, seed=len(row.output_ids), spread=2.0)
        logits = torch.cat([random_logits(others, seed=99 + len(row.output_ids)), base]) if others else base
        ids = DefaultSampler().sample(logits, noise + [row])
        row.output_ids.append(int(ids[-1]))
    return row.output_ids


def test_seeded_streams_with_every_feature_are_reproducible_and_batch_independent():
    params = SamplingParams(
        temperature=0.9, top_k=60, top_p=0.95, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.3,
        frequency_penalty=0.2, logit_bias={11: 2.0}, seed=42,
    )
    alone = _stream(params, seed=42, others=0)
    assert alone == _stream(params, seed=42, others=5)
    assert alone != _stream(params, seed=43, others=0)
