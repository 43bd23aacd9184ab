"""Sampling parameters and the sampler interface."""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcore.errors import InvalidRequestError

__all__ = ["SamplingParams", "Sampler", "DefaultSampler"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter; must be in (0, 1]
    seed: int | None = None  # per-request RNG seed; same seed → same stream
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # suppress EOS: generate exactly max_new_tokens (benchmarks, conformance)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler(abc.ABC):
    """Turns the last position's logits of each sequence into the next token."""

    @abc.abstractmethod
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Pick one token per row.

        :param logits: ``[B, V]`` float32 logits of each sequence's last position.
        :param params: one :class:`SamplingParams` per row.
        :param generators: one RNG per row (``None`` for greedy rows).
        :returns: ``[B]`` int64 token ids.
        """


class DefaultSampler(Sampler):
    """Greedy, or temperature → top-k → top-p → multinomial draw from the row's own generator.

    Each row draws from its own generator, so a request's stream depends only on its seed and its
    logits, not on what else shares the batch.
    """

    def sample(self, logits, params, generators):
        next_ids = logits.argmax(dim=-1)  # [B]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        for i in sampled_rows:  # per request (not per token): each row has its own generator
            next_ids[i] = self._sample_row(logits[i], params[i], generators[i])
        return next_ids

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
        scores = logits.float() / p.temperature  # [V]
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # drop a token when the tokens before it already reach top_p (the top token always stays)
            drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= p.top_p
            scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
        probs = scores.softmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[0]
