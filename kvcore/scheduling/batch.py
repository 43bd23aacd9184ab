"""What the scheduler hands the engine for one step: the rows of one forward call, and the requests that
can never run."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.errors import KVCoreError
from kvcore.scheduling.request import Request

__all__ = ["ScheduledBatch", "SchedulerOutput"]


@dataclass
class ScheduledBatch:
    """One forward call: ``query_lens[i]`` new tokens of ``requests[i]`` after its computed ones."""

    requests: list[Request]
    query_lens: list[int]
    is_decode: list[bool]  # per row: a decode row (one token after a fully computed sequence)

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
