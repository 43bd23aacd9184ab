"""Sampling parameters, the sampler interface and the default sampler (a built-in plugin)."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from kvcore.errors import ConfigError, InvalidRequestError, KVCoreError, SamplerError
from kvcore.hookspecs import hookimpl
from kvcore.logits_processors import apply_penalties, argmax_rows, min_p_mask, token_logprobs, uniform_noise

__all__ = [
    "MAX_LOGPROBS", "SAMPLING_FEATURES", "SamplingParams", "SamplingRow", "Sampler", "DefaultSampler",
    "sample_checked", "uniform_noise",
]


#: most alternatives ``logprobs`` may ask for (OpenAI's and vLLM's default cap)
MAX_LOGPROBS = 20
#: allowed range of a ``logit_bias`` value (OpenAI's)
MAX_LOGIT_BIAS = 100.0
#: the standard :class:`SamplingParams` features a sampler may implement as this module defines them
#: (``Sampler.features``; the conformance suite checks each declared one against its reference)
SAMPLING_FEATURES = frozenset({
    "greedy", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs",
})


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (OpenAI / vLLM semantics).

    Order of the logits processing (vLLM's): ``logit_bias`` (added) → ``repetition_penalty`` (prompt and
    output tokens) → ``frequency_penalty`` / ``presence_penalty`` (output tokens) → greedy argmax, or
    temperature → top-k → top-p → min-p → a draw. Penalties and bias also apply to greedy requests;
    top-k/top-p/min-p/seed only matter when sampling. Frozen and hashable: ``stop`` and ``logit_bias``
    are stored as tuples.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below 1e-5) = greedy (argmax)
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter; must be in (0, 1]
    seed: int | None = None  # per-request RNG seed; same seed → same stream (sample i of n uses seed + i)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # suppress EOS: generate exactly max_new_tokens (benchmarks, conformance)
    n: int = 1  # independent samples of the prompt (they share its KV blocks); see Engine.sample_ids
    #: stop strings: generation ends (FinishReason.STOP) when the decoded text contains one; the stop
    #: string and anything after it are not returned. A single string is accepted too.
    stop: tuple[str, ...] = field(default_factory=tuple)
    min_p: float = 0.0  # drop tokens with probability < min_p × the top token's (0 = off); in [0, 1]
    #: CTRL / transformers: the logit of every token already in prompt or output is divided by it when
    #: positive, multiplied when negative. 1 = off; must be > 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated; in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: minus this × how often the token was generated; in [-2, 2]
    #: added to the logits of these token ids before anything else: a dict ``{token_id: bias}`` or pairs,
    #: stored as sorted ``((token_id, bias), ...)``; bias in [-100, 100] (OpenAI)
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = field(default_factory=tuple)
    #: None = off; k >= 0 = report the chosen token's log-probability and the k most likely alternatives
    #: (at most MAX_LOGPROBS), from the final processed distribution (see DefaultSampler)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequestError(f"n must be a positive integer, got {self.n!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    #: temperatures below this are greedy (vLLM's rule): dividing logits by them overflows float32 and the
    #: distribution they describe is the argmax anyway
    GREEDY_BELOW = 1e-5

    @property
    def is_greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty or bias changes the logits (they apply to greedy requests too)."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.logit_bias
        )


def _checked_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{id: bias}`` or ``((id, bias), ...)`` → sorted pairs; ids may be decimal strings (JSON object keys)."""
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {value!r}") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise InvalidRequestError(f"logit_bias entries must be (token_id, bias) pairs, got {pair!r}")
        key, bias = pair
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidRequestError(f"logit_bias: token id must be an integer >= 0, got {key!r}")
        if not (_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(f"logit_bias: bias of token {token} must be in [-100, 100], got {bias!r}")
        if token in out:
            raise InvalidRequestError(f"logit_bias: token id {token} is given twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


class SamplingRow(Protocol):
    """What a sampler sees of each row's request (the engine's request state; read only)."""

    request_id: str
    prompt_ids: list[int]  # the prompt's token ids
    output_ids: list[int]  # tokens generated so far (the row's history, e.g. for repetition penalties)
    params: SamplingParams
    seed: int  # the request's RNG seed: params.seed, or one drawn when the request was added


class Sampler(abc.ABC):
    """Turns the last position's logits of each sequence into the next token.

    Subclass it, declare ``name`` (and ``description``), implement :meth:`sample`, and register the class
    through the ``kvcore_register_samplers`` hook. Constructor keywords come from the config file's
    ``[samplers.<name>]`` table.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: the :data:`SAMPLING_FEATURES` this sampler implements exactly as :class:`SamplingParams` defines them;
    #: all of them unless it declares fewer (a sampler that reshapes a feature its own way leaves it out)
    features: ClassVar[frozenset[str]] = SAMPLING_FEATURES

    def __init__(self, **options: Any) -> None:
        if options:
            raise ConfigError(f"sampler '{self.name}' got unknown options: {', '.join(sorted(options))}")

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when the sampler can run here, else a one-line reason. Must not raise."""
        return None

    @abc.abstractmethod
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Pick one token per row.

        :param logits: ``[B, V]`` float32 logits of each sequence's last position (any device; EOS
            already masked for ``ignore_eos`` rows). The sampler may modify them in place.
        :param rows: one :class:`SamplingRow` per logits row: request id, prompt and generated ids,
            :class:`SamplingParams`, seed.
        :returns: ``[B]`` int64 token ids on ``logits.device``.
        """

    def logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """``[B, V]`` log-probabilities of the distribution :meth:`sample` draws from, for requests that ask
        for ``logprobs`` (called on a copy of the logits, before :meth:`sample`). This default is
        ``log_softmax`` of the logits as given; a sampler that reshapes the distribution overrides it."""
        return logits.float().log_softmax(-1)


def sample_checked(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
    """``sampler``'s ids for ``rows``, checked: one int64 id per row, inside the vocabulary. Anything else,
    or an exception, is a :class:`~kvcore.errors.SamplerError` naming the sampler. Second: per row, None,
    or with ``params.logprobs`` set ``(logprob of the id, top (id, logprob) pairs)``."""
    name = sampler.name
    num_top = [r.params.logprobs for r in rows]
    try:
        logprobs = sampler.logprobs(logits.clone(), rows) if any(k is not None for k in num_top) else None
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
    if not isinstance(logprobs, torch.Tensor) or tuple(logprobs.shape) != tuple(logits.shape):
        raise SamplerError(f"sampler '{name}' returned logprobs that are not a {tuple(logits.shape)} tensor")
    return next_ids, token_logprobs(logprobs, ids, num_top)


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
