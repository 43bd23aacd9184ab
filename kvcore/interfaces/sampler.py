"""The sampler contract: per-request sampling parameters, the row view a sampler receives, the interface."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvcore.errors import InvalidRequestError, reject_unknown_keywords
from kvcore.interfaces.options import unknown_options_error
from kvcore.interfaces.setting import setting
from kvcore.interfaces.structured import StructuredOutput

if TYPE_CHECKING:  # annotations only: the command line reads SamplingParams' settings before torch loads
    import torch

__all__ = ["MAX_LOGPROBS", "MAX_LOGIT_BIAS", "SAMPLING_FEATURES", "SamplingParams", "SamplingRow", "Sampler"]


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


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@reject_unknown_keywords
@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (OpenAI / vLLM semantics).

    Order of the logits processing (vLLM's): ``logit_bias`` (added) → ``repetition_penalty`` (prompt and
    output tokens, or the last ``repetition_window`` of them) → ``frequency_penalty`` / ``presence_penalty``
    (output tokens) → greedy argmax, or temperature → top-k → top-p → min-p → a draw. Penalties and bias also
    apply to greedy requests; top-k/top-p/min-p/seed only matter when sampling. Frozen and hashable: ``stop``
    and ``logit_bias`` are stored as tuples.
    """

    max_new_tokens: int = setting(128, help="tokens to generate (default {default})")
    temperature: float = setting(0.0, help="0 = greedy (generate's default; chat samples at 0.8, see docs/cli.md)")
    top_k: int = setting(0, help="sample from the k most likely tokens (0 = off)")
    top_p: float = setting(1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    #: same seed → same stream (sample i of n uses seed + i)
    seed: int | None = setting(None, help="RNG seed for sampling (any integer; taken mod 2^64)")
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: generate exactly max_new_tokens (benchmarks, conformance)
    ignore_eos: bool = setting(False, help="do not stop at end-of-sequence")
    n: int = 1  # independent samples of the prompt (they share its KV blocks); see Engine.sample_ids
    #: generation ends (FinishReason.STOP) when the decoded text contains one; the stop string and anything
    #: after it are not returned. A single string is accepted too.
    stop: tuple[str, ...] = setting((), help="stop when the text contains TEXT (not printed); repeat for several",
                                    metavar="TEXT")
    min_p: float = setting(0.0, help="drop tokens below min_p × the top probability (0 = off)")
    #: CTRL / transformers: applies to every token already in prompt or output; must be > 0
    repetition_penalty: float = setting(
        1.0, help="divide seen tokens' positive logits by it, multiply negative ones (1 = off)")
    #: Ollama's ``repeat_last_n``, llama.cpp's ``penalty_last_n``; None = all of them (vLLM, transformers)
    repetition_window: int | None = setting(
        None, help="the repetition penalty counts only the last N tokens (default: all; chat: 64)", metavar="N")
    #: OpenAI: minus this once for every token already generated
    presence_penalty: float = setting(0.0, help="OpenAI presence penalty in [-2, 2]")
    #: OpenAI: minus this × how often the token was generated
    frequency_penalty: float = setting(0.0, help="OpenAI frequency penalty in [-2, 2]")
    #: added to the logits of these token ids before anything else: a dict ``{token_id: bias}`` or pairs,
    #: stored as sorted ``((token_id, bias), ...)``; bias in [-100, 100] (OpenAI)
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = field(default_factory=tuple)
    #: None = off; k >= 0 = report the chosen token's log-probability and the k most likely alternatives
    #: (at most MAX_LOGPROBS), from the final processed distribution (see DefaultSampler)
    logprobs: int | None = setting(
        None, help="with --json: each token's logprob and its K most likely alternatives (0-20)", metavar="K")
    #: prefix caching shares K/V only between requests with the same salt (None is a salt of its own):
    #: give each tenant its own so no one can tell from timing what another's prompts began with
    cache_salt: str | None = None
    #: constrain the output to a JSON schema, JSON object, regex, choice or grammar (needs llguidance)
    structured_output: StructuredOutput | None = None
    #: OpenAI's and vLLM's name for ``max_new_tokens``, accepted when constructing (read ``max_new_tokens``)
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            default = type(self).__dataclass_fields__["max_new_tokens"].default
            if self.max_new_tokens not in (default, max_tokens):
                raise InvalidRequestError(
                    f"max_tokens ({max_tokens!r}) and max_new_tokens ({self.max_new_tokens!r}) disagree; give one")
            object.__setattr__(self, "max_new_tokens", max_tokens)
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
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
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
        w = self.repetition_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise InvalidRequestError(
                f"repetition_window must be None (the whole context) or an integer >= 1, got {w!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutput):
            raise InvalidRequestError(f"structured_output must be a kvcore.StructuredOutput, got {so!r}")

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


def _checked_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
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
            raise unknown_options_error("sampler", self.name, "samplers", type(self), options)

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
