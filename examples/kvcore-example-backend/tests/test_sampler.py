"""``example_repetition_penalty`` against Hugging Face's ``RepetitionPenaltyLogitsProcessor``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from kvcore_example_backend import RepetitionPenaltySampler, apply_repetition_penalty

from kvcore import DefaultSampler, Sampler, SamplingParams
from kvcore.errors import ConfigError
from kvcore.plugins.registry import SAMPLER


@dataclass
class Row:
    """What a sampler sees of one request (kvcore's ``SamplingRow``)."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    request_id: str = "r"


def random_rows(gen: torch.Generator, num_rows: int, vocab: int) -> list[Row]:
    rows = []
    for i in range(num_rows):
        prompt_len, output_len = torch.randint(1, 40, (2,), generator=gen).tolist()
        ids = torch.randint(0, vocab // 4 if i % 2 else vocab, (prompt_len + output_len,), generator=gen).tolist()
        rows.append(Row(ids[:prompt_len], ids[prompt_len:]))  # odd rows: few distinct ids, many repeats
    return rows


@pytest.mark.parametrize("penalty", [1.2, 2.0, 7.5])
def test_matches_transformers(penalty):
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(int(penalty * 10))
    vocab = 97
    rows = random_rows(gen, 6, vocab)
    logits = torch.randn(len(rows), vocab, generator=gen) * 4
    logits[:, :5] = 0.0  # zeros stay zero both ways
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=penalty)
    expected = torch.cat([  # HF takes one [1, len] id tensor per row: histories are ragged
        processor(torch.tensor([r.prompt_ids + r.output_ids]), logits[i : i + 1].clone())
        for i, r in enumerate(rows)
    ])
    out = apply_repetition_penalty(logits.clone(), [r.prompt_ids + r.output_ids for r in rows], penalty)
    assert torch.equal(out, expected)


def test_penalises_in_place_each_distinct_token_once_and_nothing_else():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_repetition_penalty(logits, [[0, 1, 0, 0], [4], []], 2.0)
    assert out is logits
    expected = torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.25], [2.0, -2.0, 1.0, -1.0, 0.5]])
    assert torch.equal(logits, expected)


def test_greedy_picks_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0], [3.0, 2.9, 0.0, -1.0], [-1.0, -1.1, -5.0, -9.0]])
    rows = [Row([0]), Row([1], [2]), Row([3], [0])]
    assert DefaultSampler().sample(logits, rows).tolist() == [0, 0, 0]
    assert RepetitionPenaltySampler(penalty=1.2).sample(logits, rows).tolist() == [1, 0, 1]


def test_sampled_rows_delegate_to_the_default_sampler():
    gen = torch.Generator().manual_seed(3)
    rows = random_rows(gen, 5, 64)
    for i, row in enumerate(rows):
        row.params, row.seed = SamplingParams(temperature=0.8, top_k=20 * (i % 2), top_p=0.9), 100 + i
    logits = torch.randn(5, 64, generator=gen)
    penalised = apply_repetition_penalty(logits.clone(), [r.prompt_ids + r.output_ids for r in rows], 1.5)
    picked = RepetitionPenaltySampler(penalty=1.5).sample(logits.clone(), rows)
    assert picked.dtype == torch.int64
    assert torch.equal(picked, DefaultSampler().sample(penalised, rows))


def test_base_sampler_option():
    class Last(Sampler):
        name = "last"

        def sample(self, logits, rows):
            return torch.full((logits.shape[0],), logits.shape[1] - 1)

    assert RepetitionPenaltySampler(base=Last()).sample(torch.zeros(2, 5), [Row([0]), Row([1])]).tolist() == [4, 4]
    assert isinstance(RepetitionPenaltySampler(base="default").base, DefaultSampler)
    with pytest.raises(ConfigError, match="itself"):
        RepetitionPenaltySampler(base="example_repetition_penalty")


@pytest.mark.parametrize("bad", [1.0, 1, 0.8, 0.0, -2.0, float("inf"), float("nan"), True, "1.5", None])
def test_penalty_must_be_a_number_above_one(bad):
    with pytest.raises(ConfigError, match="penalty must be a number > 1"):
        RepetitionPenaltySampler(penalty=bad)


def test_options_and_registration(registry):
    assert RepetitionPenaltySampler().penalty == 1.2
    assert RepetitionPenaltySampler(penalty=2).penalty == 2.0
    with pytest.raises(ConfigError, match="alpha"):
        RepetitionPenaltySampler(alpha=0.5)
    assert registry.get("example_repetition_penalty", SAMPLER).cls is RepetitionPenaltySampler
    made = registry.create_sampler("example_repetition_penalty", {"penalty": 1.5})
    assert isinstance(made, RepetitionPenaltySampler) and made.penalty == 1.5
    with pytest.raises(ConfigError, match="penalty"):
        registry.create_sampler("example_repetition_penalty", {"penalty": 1.0})
