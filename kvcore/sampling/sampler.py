"""The default sampler (a built-in plugin) and the core's checked call of any sampler."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcore.errors import KVCoreError, SamplerError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.sampler import Sampler, SamplingRow
from kvcore.sampling.processors import apply_penalties, argmax_rows, min_p_mask, token_logprobs, uniform_noise

__all__ = ["DefaultSampler", "logprobs_checked", "sample_checked", "uniform_noise"]


def sample_checked(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
    """``sampler``'s ids for ``rows``, checked: one int64 id per row, inside the vocabulary. Anything else,
    or an exception, is a :class:`~kvcore.errors.SamplerError` naming the sampler. Second: per row, None,
    or with ``params.logprobs`` set ``(logprob of the id, top (id, logprob) pairs)``."""
    name = sampler.name
    num_top = [r.params.logprobs for r in rows]
    logprobs = logprobs_checked(sampler, logits, rows) if any(k is not None for k in num_top) else None
    try:
        ids = sampler.sample(logits, rows)
    except KVCoreError:
        raise
    except Exception as exc:
        raise SamplerError(f"sampler '{name}' failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (len(rows),) or ids.dtype != torch.int64:
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise SamplerError(f"sampler '{name}' returned {got}; expected ({len(rows)},) torch.int64 token ids")
    next_ids = ids.tolist()
    vocab = logits.shape[-1]
    bad = [t for t in next_ids if not 0 <= t < vocab]
    if bad:
        raise SamplerError(f"sampler '{name}' returned token id {bad[0]}, outside the vocabulary [0, {vocab})")
    if logprobs is None:
        return next_ids, [None] * len(rows)
    return next_ids, token_logprobs(logprobs, ids, num_top)


def logprobs_checked(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``sampler.logprobs`` of a copy of ``logits``, checked: a tensor of their shape. Anything else, or an
    exception, is a :class:`~kvcore.errors.SamplerError` naming the sampler."""
    try:
        logprobs = sampler.logprobs(logits.clone(), rows)
    except KVCoreError:
        raise
    except Exception as exc:
        raise SamplerError(f"sampler '{sampler.name}' failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(logprobs, torch.Tensor) or tuple(logprobs.shape) != tuple(logits.shape):
        raise SamplerError(f"sampler '{sampler.name}' returned logprobs that are not a {tuple(logits.shape)} "
                           "tensor")
    return logprobs


class DefaultSampler(Sampler):
    """Bias and penalties, then greedy, or temperature → top-k → top-p → min-p → a draw; vectorised over the
    batch on the logits' device.

    The draw is the Gumbel-max trick (``argmax(logits / T + Gumbel noise)`` samples ``softmax(logits / T)``)
    with :func:`uniform_noise`, so each row's stream depends only on its seed, its step and its logits.
    Log-probabilities (:meth:`logprobs`) are those of the final processed distribution the token is drawn
    from (vLLM's ``processed_logprobs``): after bias, penalties, temperature and the top-k / top-p / min-p
    filters (removed tokens: -inf). A greedy row's are ``log_softmax`` of its biased, penalised logits.
    """

    name = "default"
    description = (
        "greedy, or temperature / top-k / top-p / min-p with per-request seeds; penalties, logit bias, "
        "logprobs; vectorised, on-device"
    )

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        apply_penalties(logits, rows)
        next_ids = argmax_rows(logits)  # [B]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled:
            return next_ids
        idx = torch.tensor(sampled, device=logits.device)
        picked = [rows[i] for i in sampled]
        sorted_scores, order = self._filtered(logits[idx], picked)  # [S, V] each
        steps = [len(r.output_ids) for r in picked]
        u = uniform_noise([r.seed for r in picked], steps, logits.shape[-1], logits.device)  # [S, V]
        gumbel = -torch.log(-torch.log(u.gather(1, order)))  # noise keyed by token id, laid out sorted
        choice = (sorted_scores + gumbel).argmax(-1, keepdim=True)  # [S, 1] in sorted order
        next_ids[idx] = order.gather(1, choice)[:, 0]
        return next_ids

    def logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        apply_penalties(logits, rows)
        out = logits.float().log_softmax(-1)  # [B, V]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            sorted_scores, order = self._filtered(logits[idx], [rows[i] for i in sampled])
            out[idx] = torch.empty_like(out[idx]).scatter_(1, order, sorted_scores.log_softmax(-1).float())
        return out

    @staticmethod
    def _filtered(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, then top-k, top-p and min-p of sampled rows: float64 scores sorted in descending
        order, removed tokens -inf, and the token id of each sorted position (both ``[S, V]``)."""
        device, vocab = logits.device, logits.shape[-1]
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)[:, None]
        scores = logits.float() / temperature  # [S, V]
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # [S, V]
        sorted_scores = sorted_scores.double()
        top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device)[:, None]
        sorted_scores = sorted_scores.masked_fill(torch.arange(vocab, device=device)[None, :] >= top_k, -math.inf)
        # float64 thresholds: a top_p far below float32's range (1e-46) must still keep the top token
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=device)[:, None]
        probs = sorted_scores.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        sorted_scores = sorted_scores.masked_fill((probs.cumsum(-1) - probs) >= top_p, -math.inf)
        if any(r.params.min_p > 0 for r in rows):  # decided on the host: no device sync
            min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float64, device=device)[:, None]
            sorted_scores = sorted_scores.masked_fill(min_p_mask(sorted_scores.softmax(-1), min_p), -math.inf)
        return sorted_scores, order


@hookimpl
def kvcore_register_samplers(register):
    register(DefaultSampler)
