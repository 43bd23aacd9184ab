"""What the scheduler and the engine hand each other in one step: the rows of one forward call and the requests
that can never run (:meth:`~kvcore.scheduling.scheduler.Scheduler.schedule`), then what the forward and the
sampler gave those rows (:meth:`~kvcore.scheduling.scheduler.Scheduler.update_from_output`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.errors import KVCoreError
from kvcore.scheduling.request import Request

__all__ = ["Logprob", "ModelOutput", "Sampled", "ScheduledBatch", "SchedulerOutput"]

#: with ``params.logprobs`` set: a token's logprob and the top ``(token id, logprob)`` pairs, most likely first
Logprob = tuple[float, list[tuple[int, float]]]
#: one sampled token: its id, and its :data:`Logprob` (None without ``params.logprobs``)
Sampled = tuple[int, Logprob | None]


@dataclass
class ScheduledBatch:
    """One forward call: ``query_lens[i]`` new tokens of ``requests[i]`` after its computed ones."""

    requests: list[Request]
    query_lens: list[int]
    is_decode: list[bool]  # per row: a decode row (one token after a fully computed sequence)
    #: the copy-on-write block copies (src, dst) that reserving these rows made (tensor parallelism repeats them)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """Whether any row is a prefill (chunk): the step then runs on the prefill backend."""
        return not all(self.is_decode)

    @property
    def input_ids(self) -> list[int]:
        """The packed token ids to compute: each row's next ``query_len`` uncomputed tokens."""
        ids: list[int] = []
        for req, n, decode in zip(self.requests, self.query_lens, self.is_decode):
            start = req.num_computed_tokens
            ids.extend(req.output_ids[-1:] if decode else req.all_ids[start : start + n])
        return ids

    @property
    def samples(self) -> list[bool]:
        """Per row: whether it completes its sequence, so its last position's logits give a token."""
        return [r.num_computed_tokens + n == r.num_tokens for r, n in zip(self.requests, self.query_lens)]


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch | None = None
    failed: list[tuple[Request, KVCoreError]] = field(default_factory=list)  # can never run


@dataclass
class ModelOutput:
    """What one forward of ``batch`` and its sampler gave, for the scheduler to settle: per row, the tokens it
    emits in order (``[]``: none, a partly prefilled row); ``forks``: the first token of each sample of an
    ``n > 1`` group whose leader completed its prompt in this forward, by request id.

    ``num_drafts`` (a speculative step, else None): per row, the draft tokens scored after its last token. Its
    K/V were written for all of them, but the cache keeps only the tokens the row emits."""

    batch: ScheduledBatch
    tokens: list[list[Sampled]]
    forks: dict[str, Sampled] = field(default_factory=dict)
    num_drafts: list[int] | None = None
