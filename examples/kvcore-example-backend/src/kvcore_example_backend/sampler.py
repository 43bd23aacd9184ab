"""``example_repetition_penalty``: the CTRL repetition penalty, then another sampler picks the token.

Every token id that occurs in a row's history (its prompt and the tokens generated so far) has its
logit pushed down by ``penalty`` (Keskar et al. 2019, "CTRL", as Hugging Face's
``RepetitionPenaltyLogitsProcessor`` does it)::

    logit > 0  →  logit / penalty
    logit < 0  →  logit · penalty

once per distinct token, however often it occurred. The whole batch is one ``gather`` and one
``scatter_`` over a ``[B, max_history]`` id tensor, on the logits' device; the penalised logits then
go to the ``base`` sampler (kvcore's ``default``: greedy, or temperature / top-k / top-p per request).

Options (``[samplers.example_repetition_penalty]``): ``penalty`` (a number > 1, default 1.2) and
``base`` (the name of a registered sampler, or a :class:`~kvcore.Sampler` instance; default ``default``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvcore import DefaultSampler, Sampler, SamplingRow
from kvcore.errors import ConfigError
from kvcore.interfaces.sampler import SAMPLING_FEATURES

__all__ = ["RepetitionPenaltySampler", "apply_repetition_penalty"]


def apply_repetition_penalty(logits: torch.Tensor, histories: Sequence[Sequence[int]], penalty: float) -> torch.Tensor:
    """Penalise, in place, the logits ``[B, V]`` of every token id in ``histories[i]`` (row ``i``); returns ``logits``.

    Rows are padded to the longest history with a repeat of their own first id, which the scatter writes
    twice with the same value; an empty history is padded with id 0 and left untouched.
    """
    unique = [list(dict.fromkeys(h)) for h in histories]  # distinct ids, first-seen order
    width = max((len(h) for h in unique), default=0)
    if width == 0:
        return logits
    device = logits.device
    ids = torch.tensor([h + [h[0] if h else 0] * (width - len(h)) for h in unique], device=device)  # [B, W]
    has_history = torch.tensor([bool(h) for h in unique], device=device)[:, None]  # [B, 1]
    score = logits.gather(1, ids)  # [B, W]
    penalised = torch.where(score > 0, score / penalty, score * penalty)
    logits.scatter_(1, ids, torch.where(has_history, penalised, score))
    return logits


class RepetitionPenaltySampler(Sampler):
    name = "example_repetition_penalty"
    description = "example plugin: CTRL repetition penalty over prompt + output, then the default sampler"
    #: its own penalty comes on top of any the request asks for, so the penalties are not the standard ones
    features = SAMPLING_FEATURES - {"repetition_penalty", "presence_penalty", "frequency_penalty"}

    def __init__(self, penalty: float = 1.2, base: str | Sampler = "default", **options: Any) -> None:
        super().__init__(**options)  # rejects unknown options
        is_number = isinstance(penalty, (int, float)) and not isinstance(penalty, bool)
        if not (is_number and math.isfinite(penalty) and penalty > 1):
            raise ConfigError(
                f"sampler '{self.name}': penalty must be a number > 1 (1 would change nothing; "
                f"< 1 would reward repetition), got {penalty!r}"
            )
        self.penalty = float(penalty)
        self.base = self._base_sampler(base)

    def _base_sampler(self, base: str | Sampler) -> Sampler:
        if isinstance(base, Sampler):
            return base
        if base == DefaultSampler.name:
            return DefaultSampler()
        if base == self.name:
            raise ConfigError(f"sampler '{self.name}': base cannot be '{self.name}' itself")
        if not isinstance(base, str):
            raise ConfigError(f"sampler '{self.name}': base must be a sampler name, got {base!r}")
        from kvcore.plugins.registry import get_registry

        return get_registry().create_sampler(base)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        apply_repetition_penalty(logits, [r.prompt_ids + r.output_ids for r in rows], self.penalty)
        return self.base.sample(logits, rows)

    def logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The base sampler's log-probabilities of the penalised logits: what :meth:`sample` draws from."""
        apply_repetition_penalty(logits, [r.prompt_ids + r.output_ids for r in rows], self.penalty)
        return self.base.logprobs(logits, rows)
