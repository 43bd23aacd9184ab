"""The sampler oracle's scenarios: synthetic rows (logits over a small vocabulary, a history, one
:class:`~kvcore.interfaces.sampler.SamplingParams`) covering every standard sampling feature and its boundaries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvcore.conformance.sampler_reference import RowReference, reference_row
from kvcore.interfaces.sampler import SamplingParams

__all__ = ["Row", "Scenario", "OracleCase", "scenarios", "oracle_cases", "num_chi_square_tests", "NUM_DRAWS",
           "FAMILY_ALPHA", "VOCAB", "GREEDY_ROWS", "MASKED"]

VOCAB = 64
#: tokens whose logit is -inf in every scenario; the history of scenarios without penalties uses them, so a
#: penalty a sampler applies on its own changes nothing there
MASKED = tuple(range(56, 64))
NUM_DRAWS = 1000
GREEDY_ROWS = 32
#: probability that a correct sampler fails any chi-square test of one run (split evenly between the tests)
FAMILY_ALPHA = 1e-3


@dataclass(frozen=True)
class Row:
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
    prompt_ids: tuple[int, ...] = MASKED[:4]
    output_ids: tuple[int, ...] = MASKED[4:6]

    def row(self, seed: int, request_id: str) -> Row:
        return Row(request_id, list(self.prompt_ids), list(self.output_ids), self.params, seed)

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
    return x.tolist() + [-math.inf] * len(MASKED)


def _with(values: dict[int, float], base: list[float] | None = None, fill: float | None = None) -> tuple[float, ...]:
    x = list(base if base is not None else _base_logits())
    if fill is not None:
        x = [fill] * 56 + [-math.inf] * len(MASKED)
    for i, v in values.items():
        x[i] = v
    return tuple(x)


def _penalty_logits() -> tuple[float, ...]:
    """Small base logits (|x| <= 0.25) and four stand-outs: 10 (in the prompt), 20 (in the output, three
    times), 30 (in neither), 11 (negative, in the prompt)."""
    small = [v / 8 for v in _base_logits()[:56]] + [-math.inf] * len(MASKED)
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
        Scenario("repetition_penalty-window", "repetition_penalty over the last 4 tokens (prompt token 10 is older)",
                 pen, P(temperature=0.0, repetition_penalty=100.0, repetition_window=4), **hist),
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


def num_chi_square_tests() -> int:
    return sum(not s.params.is_greedy for s in scenarios())
