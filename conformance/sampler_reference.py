"""kvcore's reference for what a row is drawn from: each :class:`~kvcore.sampling.sampler.SamplingParams` feature
written out literally, one row at a time, in float64 (the sampler oracle's ground truth).

A row's processed scores are grouped into *levels*: tokens holding exactly the same score. A filter that
cuts through a level (top-k ``k`` or top-p at an exact cumulative boundary inside a tie, e.g. four tokens of
probability 0.25 each and ``top_p = 0.75``) keeps a known *number* of its tokens but leaves *which* ones to
the implementation, so the reference says "``kept`` of these ``tokens``, each with probability ``prob``".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.interfaces.sampler import SamplingParams

__all__ = ["Level", "RowReference", "reference_row", "processed_logits", "features_used"]


@dataclass(frozen=True)
class Level:
    score: float  # the processed score (after bias, penalties and temperature) every token here holds
    tokens: tuple[int, ...]  # the token ids holding it, ascending
    kept: int  # how many of them the filters keep (0 .. len(tokens))
    prob: float  # probability of each kept token

    @property
    def is_ambiguous(self) -> bool:
        """A filter cut through this tie: which ``kept`` tokens stay is the implementation's choice."""
        return 0 < self.kept < len(self.tokens)


@dataclass(frozen=True)
class RowReference:
    processed: torch.Tensor  # [V] float64 logits after logit_bias and the penalties
    greedy_token: int | None  # greedy rows: the first index of the processed maximum (torch.argmax's choice)
    levels: tuple[Level, ...]  # sampled rows: the distribution, highest score first; greedy rows: ()

    @property
    def support(self) -> set[int]:
        """Tokens a draw may return (every token of a level that keeps any)."""
        if self.greedy_token is not None:
            return {self.greedy_token}
        return {t for lv in self.levels if lv.kept for t in lv.tokens}

    def logprobs(self) -> tuple[torch.Tensor, list[Level]]:
        """``[V]`` float64 log-probabilities of the distribution (greedy rows: ``log_softmax`` of the processed
        logits, as :meth:`~kvcore.sampling.sampler.Sampler.logprobs` defines them) with NaN where a tie was cut
        (those tokens' values are the implementation's choice), and the cut levels."""
        if self.greedy_token is not None:
            return self.processed.log_softmax(-1), []
        out = torch.full_like(self.processed, -math.inf)
        cut = []
        for lv in self.levels:
            value = math.log(lv.prob) if lv.kept else -math.inf
            out[list(lv.tokens)] = math.nan if lv.is_ambiguous else value
            if lv.is_ambiguous:
                cut.append(lv)
        return out, cut


def features_used(params: SamplingParams) -> set[str]:
    """The :data:`~kvcore.sampling.sampler.SAMPLING_FEATURES` a request with ``params`` relies on."""
    used = {"greedy"} if params.is_greedy else {"temperature"}
    if not params.is_greedy:
        used |= {f for f, on in (("top_k", params.top_k), ("top_p", params.top_p < 1.0), ("min_p", params.min_p > 0))
                 if on}
    used |= {f for f, on in (("repetition_penalty", params.repetition_penalty != 1.0),
                             ("presence_penalty", params.presence_penalty),
                             ("frequency_penalty", params.frequency_penalty), ("logit_bias", params.logit_bias)) if on}
    if params.logprobs is not None:
        used.add("logprobs")
    return used


def processed_logits(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                     params: SamplingParams) -> torch.Tensor:
    """``logit_bias`` added; ``repetition_penalty`` on every distinct token of prompt + output, or of their last
    ``repetition_window`` tokens (``x / p`` when ``x > 0`` else ``x * p``); then ``frequency_penalty × count +
    presence_penalty`` subtracted for every token the output holds ``count > 0`` times. ``[V]`` float64."""
    x = logits.detach().double().cpu().clone()
    vocab = x.numel()
    for token, bias in params.logit_bias:
        if token < vocab:
            x[token] += bias
    if params.repetition_penalty != 1.0:
        seen = list(prompt_ids) + list(output_ids)
        if params.repetition_window is not None:
            seen = seen[-params.repetition_window:]
        for token in set(seen):
            value = float(x[token])
            x[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(output_ids).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def _levels(scores: torch.Tensor) -> list[tuple[float, tuple[int, ...]]]:
    by_score: dict[float, list[int]] = {}
    for token, value in enumerate(scores.tolist()):
        if value != -math.inf:
            by_score.setdefault(value, []).append(token)
    return [(s, tuple(by_score[s])) for s in sorted(by_score, reverse=True)]


def _probs(levels: list[tuple[float, tuple[int, ...]]], kept: list[int]) -> list[float]:
    top = levels[0][0]
    weights = [math.exp(s - top) for s, _ in levels]
    z = sum(w * k for w, k in zip(weights, kept))
    return [w / z for w in weights]


def reference_row(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                  params: SamplingParams) -> RowReference:
    """What :class:`~kvcore.sampling.sampler.SamplingParams` says one row is drawn from (``logits``: ``[V]``).

    Greedy: the first maximum of the processed logits. Sampled, in this order: divide by ``temperature``;
    top-k keeps the ``top_k`` highest; top-p drops a token once the kept tokens ranked above it already
    hold ``top_p`` of the probability (the top token always stays); min-p drops tokens whose probability is
    below ``min_p`` times the top token's. Each filter sees the distribution renormalised after the one before.
    """
    x = processed_logits(logits, prompt_ids, output_ids, params)
    if params.is_greedy:
        return RowReference(x, int(torch.argmax(x)), ())
    levels = _levels(x / params.temperature)
    kept = [len(tokens) for _, tokens in levels]
    if params.top_k:
        room = params.top_k
        for i, n in enumerate(kept):
            kept[i], room = min(n, room), room - min(n, room)
    if params.top_p < 1.0:
        probs, before, cut = _probs(levels, kept), 0.0, False
        for i, (n, q) in enumerate(zip(kept, probs)):
            if cut:
                kept[i] = 0
                continue
            stay = sum(1 for j in range(n) if j == 0 and i == 0 or before + j * q < params.top_p)
            cut, kept[i], before = stay < n, stay, before + stay * q
    if params.min_p > 0:
        probs = _probs(levels, kept)
        top = probs[0]  # the highest level always keeps a token
        kept = [k if q >= params.min_p * top else 0 for k, q in zip(kept, probs)]
    probs = _probs(levels, kept)
    return RowReference(x, None, tuple(Level(s, t, k, q if k else 0.0)
                                       for (s, t), k, q in zip(levels, kept, probs)))
