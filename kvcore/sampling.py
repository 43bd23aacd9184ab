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

__all__ = ["MAX_LOGPROBS", "SamplingParams", "SamplingRow", "Sampler", "DefaultSampler", "sample_checked", "uniform_noise"]


#: most alternatives ``logprobs`` may ask for (OpenAI's and vLLM's default cap)
MAX_LOGPROBS = 20
#: allowed range of a ``logit_bias`` value (OpenAI's)
MAX_LOGIT_BIAS = 100.0


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


def sample_checked(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """``sampler``'s ids for ``rows``, checked: one int64 id per row, inside the vocabulary. Anything else,
    or an exception, is a :class:`~kvcore.errors.SamplerError` naming the sampler."""
    name = sampler.name
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
    return next_ids


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (lowbias32 by C. Wellons) of values in ``[0, 2^32)``, on int64 tensors or ints:
    products wrap in int64 but their low 32 bits, all that is kept, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: Sequence[int], steps: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float64 uniforms in (0, 1), a pure function of (row seed, row step, token id).

    Counter-based rather than a stateful generator: a row's draws depend only on its own seed and how many
    tokens it has generated, not on the batch it shares or the device, and the whole batch is one kernel.
    """
    keys = []
    for seed, step in zip(seeds, steps):
        seed %= 1 << 64
        k = _mix32(_mix32(seed & _MASK32) ^ _mix32(((seed >> 32) + 0x9E3779B9) & _MASK32))
        keys.append(_mix32(k ^ _mix32(step & _MASK32)))
    ids = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device))  # [V]
    h = _mix32(torch.tensor(keys, dtype=torch.int64, device=device)[:, None] ^ ids[None, :])  # [B, V]
    return (_mix32(h ^ 0x5BD1E995).double() + 0.5) / 2.0**32


class DefaultSampler(Sampler):
    """Greedy, or temperature → top-k → top-p → a draw, vectorised over the batch on the logits' device.

    The draw is the Gumbel-max trick (``argmax(logits / T + Gumbel noise)`` samples ``softmax(logits / T)``)
    with :func:`uniform_noise`, so each row's stream depends only on its seed and its logits.
    """

    name = "default"
    description = "greedy, or temperature / top-k / top-p with per-request seeds; vectorised, on-device"

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        next_ids = logits.argmax(dim=-1)  # [B]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled:
            return next_ids
        device = logits.device
        picked = [rows[i] for i in sampled]
        idx = torch.tensor(sampled, device=device)
        temperature = torch.tensor([r.params.temperature for r in picked], device=device)[:, None]
        scores = logits[idx].float() / temperature  # [S, V]
        vocab = scores.shape[-1]
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # [S, V]
        top_k = torch.tensor([r.params.top_k or vocab for r in picked], device=device)[:, None]
        sorted_scores = sorted_scores.masked_fill(torch.arange(vocab, device=device)[None, :] >= top_k, -math.inf)
        top_p = torch.tensor([r.params.top_p for r in picked], dtype=torch.float64, device=device)[:, None]
        probs = sorted_scores.double().softmax(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        sorted_scores = sorted_scores.masked_fill((probs.cumsum(-1) - probs) >= top_p, -math.inf)
        u = uniform_noise([r.seed for r in picked], [len(r.output_ids) for r in picked], vocab, device)
        gumbel = -torch.log(-torch.log(u.gather(1, order)))  # noise keyed by token id, laid out sorted
        choice = (sorted_scores.double() + gumbel).argmax(-1, keepdim=True)  # [S, 1] in sorted order
        next_ids[idx] = order.gather(1, choice)[:, 0]
        return next_ids


@hookimpl
def kvcore_register_samplers(register):
    register(DefaultSampler)
