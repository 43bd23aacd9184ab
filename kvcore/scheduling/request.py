"""Request state, per-request metrics and the results the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import KVCoreError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.text.outputs import TextOutput

__all__ = ["FinishReason", "RequestMetrics", "Request", "TokenEvent", "GenerationResult", "EngineStats", "EngineGauges"]


class FinishReason(enum.StrEnum):
    EOS = "eos"  # the model emitted an end-of-sequence / end-of-turn token
    STOP = "stop"  # a caller-given stop token id or stop string
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT = "context"  # the context window is full
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # it failed; ``error`` says why


@dataclass
class RequestMetrics:
    """Timings in seconds (``time.perf_counter``), sizes in tokens and bytes."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    kv_bytes: int = 0  # KV-cache bytes the request's tokens occupied at their peak
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache instead of computed
    num_spec_steps: int = 0  # speculative decoding: verification steps that scored drafts of this request
    num_draft_tokens: int = 0  # draft tokens scored
    num_accepted_tokens: int = 0  # draft tokens kept
    num_token_steps: int = 0  # engine steps that gave this request tokens (the prefill's last one included)
    last_token_step: int = -1  # the engine step that last did

    @property
    def acceptance_rate(self) -> float | None:
        """Kept / scored draft tokens (None without speculation)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Draft tokens kept per verification step (each step also yields one token of the target's own)."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens after the first per decode step that made them: 1.0 without speculation; with it, how many
        times fewer target forwards the request took (its speed-up before what a verification costs over a plain
        step). None before a second token."""
        steps = self.num_token_steps - 1
        return (self.num_generated_tokens - 1) / steps if steps > 0 else None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival → first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (mean inter-token latency)."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput of this request: tokens after the first / time after the first."""
        tpot = self.tpot_s
        return None if not tpot else 1.0 / tpot

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "kv_bytes": self.kv_bytes,
            "preemptions": self.num_preemptions,
            "cached_prompt_tokens": self.num_cached_tokens,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_step": self.tokens_per_step,
        }


@dataclass(eq=False)  # identity: a request is one object, compared by who it is
class Request:
    """Mutable engine-side state of one generation request (what a sampler sees as a ``SamplingRow``)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int = 0  # RNG seed of a sampled request: params.seed, or drawn when it was added
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: KVCoreError | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    seq_id: int | None = None  # KV-cache sequence while resident
    #: leading tokens of ``all_ids`` whose K/V are in the cache (a partly prefilled request has fewer than
    #: ``len(all_ids) - 1``; a decoding one exactly that: its last sampled token is not computed yet)
    num_computed_tokens: int = 0
    #: n > 1: samples 1..n-1 of this group, waiting for this one's prefill to fork its KV blocks
    pending_samples: list[Request] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # with params.logprobs: one per output id
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    #: with params.structured_output: this request's grammar matcher (kvcore.sampling.structured), fed every output id
    matcher: Any = None
    #: the caller's text of the output ids (incremental detokenising, stop strings); None: no text
    text_output: TextOutput | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        """Every token but the last sampled one is computed: the next forward is one decode row."""
        return bool(self.output_ids) and self.num_computed_tokens == self.num_tokens - 1

    def stop_reason_after(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Why generation ends after appending ``token_id`` (already in ``output_ids``), if it does."""
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS
        if token_id in p.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= p.max_new_tokens:
            return FinishReason.LENGTH
        if len(self.prompt_ids) + len(self.output_ids) >= max_model_len:
            return FinishReason.CONTEXT
        return None


@dataclass(frozen=True)
class TokenEvent:
    """One step of a streamed request: the token it produced and the text that token completed."""

    request_id: str
    token_id: int | None  # None when the request ended without a new token (abort, error)
    text: str
    finish_reason: FinishReason | None = None
    error: KVCoreError | None = None
    #: with ``params.logprobs`` set: natural-log probability of ``token_id``, and the ``logprobs`` most
    #: likely ``(token_id, logprob)`` pairs, most likely first (from the sampler's final distribution)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (an EOS that ended the stream included)
    text: str  # decoded generated text, special tokens skipped
    finish_reason: FinishReason
    metrics: RequestMetrics
    error: KVCoreError | None = None
    #: with ``params.logprobs`` set: one entry per id of ``token_ids`` (as in :class:`TokenEvent`)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: with ``params.logprobs`` set and a tokenizer: the text of each id of ``token_ids`` (vLLM's
    #: ``decoded_token``; special tokens spelled out) and of each alternative in ``top_logprobs``
    decoded_tokens: list[str] | None = None
    top_decoded_tokens: list[list[str]] | None = None


@dataclass
class EngineStats:
    """Counters since the engine was made (monotonic: Prometheus counters in a serving front).

    ``num_prefill_tokens`` counts prompt tokens a forward computed (recomputation after a preemption
    included); ``num_cached_tokens`` prompt tokens that were not computed because their K/V were already
    there: prefix-cache hits, and the shared prompt of the samples 1..n-1 of an ``n > 1`` request.
    """

    num_steps: int = 0  # forward calls
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    num_decode_tokens: int = 0  # decode rows computed (one token each)
    num_generated_tokens: int = 0  # tokens sampled
    num_preemptions: int = 0
    num_finished_requests: int = 0
    num_spec_steps: int = 0  # speculative decoding: per request, verification steps that scored drafts
    num_draft_tokens: int = 0  # draft tokens scored
    num_accepted_tokens: int = 0  # draft tokens kept

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass(frozen=True)
class EngineGauges:
    """What an engine holds at one moment (Prometheus gauges in a serving front; :class:`EngineStats` counts
    what it did)."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, not running (preempted ones included)
    num_requests_held: int  # requests the engine keeps: unfinished, or finished and not yet released
    num_kv_blocks: int  # KV-cache blocks in the pool (slots, for a per-sequence layout)
    num_kv_blocks_free: int
