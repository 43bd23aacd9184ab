"""How many drafts a request gets next, and when it stops drafting: the policy the ``ngram`` and ``draft``
proposers share.

Adaptive length (at most the engine's ``K``): a request's first proposal has at most :data:`FIRST_DRAFTS`; a
verification that keeps every draft doubles the next proposal; one that rejects a draft makes the next one more
than were kept (the length that would have been right, plus one to find out more).

Back-off: ``misses`` verifications in a row that keep nothing make the request propose nothing for
``cooldown`` steps, doubling with each back-off that follows without a kept draft in between (up to
:data:`MAX_COOLDOWN`). A request that has backed off probes with one draft; a probe that misses backs off
again at once, a kept probe ends the back-off. A step in which no request drafts is a plain one-token decode
step, so a stream the proposer cannot guess costs about what it costs without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.errors import ConfigError

__all__ = ["FIRST_DRAFTS", "MAX_COOLDOWN", "Backoff", "DraftLength", "check_positive"]

#: the longest cooldown a request backs off for, in steps
MAX_COOLDOWN = 1024
#: drafts of a request's first proposal (then doubled while all are kept): replayed on recorded streams, starting
#: at 4 rather than the engine's K loses no grounded speed-up and costs a free-form stream less
#: (benchmarks/results/speculative.md)
FIRST_DRAFTS = 4


def check_positive(proposer: str, **values: object) -> None:
    """A ConfigError unless every value is a positive integer."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"proposer '{proposer}': {key} must be a positive integer, got {value!r}")


@dataclass
class DraftLength:
    """One request's place in the policy."""

    num_drafts: int | None = None  # drafts to propose next (None: FIRST_DRAFTS)
    num_misses: int = 0  # verifications in a row that kept nothing
    num_backoffs: int = 0  # back-offs since the last kept draft
    cooldown: int = 0  # steps left without proposing

    @property
    def probing(self) -> bool:
        return self.num_backoffs > 0


class Backoff:
    def __init__(self, misses: int, cooldown: int) -> None:
        self.misses, self.cooldown = misses, cooldown

    def drafts(self, state: DraftLength, k: int) -> int:
        """How many drafts to propose this step (0 while cooling down: that step counts)."""
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        return 1 if state.probing else min(k, state.num_drafts or FIRST_DRAFTS)

    def advance(self, state: DraftLength, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        state.num_drafts = 2 * num_proposed if num_accepted == num_proposed else num_accepted + 1
        if num_accepted > 0:
            state.num_misses = state.num_backoffs = 0
            return
        state.num_misses += 1
        if state.num_misses >= self.misses or state.probing:  # a failed probe backs off at once
            state.cooldown = min(MAX_COOLDOWN, self.cooldown << state.num_backoffs)
            state.num_misses, state.num_backoffs = 0, state.num_backoffs + 1
