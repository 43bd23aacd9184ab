"""How many drafts a copy is worth: the tokens a verification is expected to yield against what it costs.

A proposal that continues a match of ``run`` tokens (the stream's last ``run`` tokens equal the ``run`` tokens
before the source position) is modelled as a chain: draft ``i`` is kept, given that the drafts before it were,
with probability ``p``. Two kinds of trial are told apart, each by run-length bucket (1, 2-3, 4-7, ... tokens,
:func:`bucket`): the first draft of a fresh match (*opening*: does the model take the turn the source took?)
and every other draft (*continuing*: a copy that held for ``run`` tokens, does it hold one more?). ``p`` is
estimated from the request's own verifications, starting from the estimate over every request the proposer
has served (the workload's) weighted as a few trials, and is kept non-decreasing along a proposal.

A verification of ``k`` drafts costs ``1 + draft_cost * k`` plain decode steps (benchmarks/verify_cost.py
measures ``draft_cost`` on a machine) and yields ``1 + p_1 + p_1 p_2 + ... + p_1 .. p_k`` tokens in
expectation. :meth:`AcceptanceModel.num_drafts` proposes the ``k`` with the best yield per cost, none where no
``k`` beats a plain step. So a short or unreliable match gets one or two drafts, a long copy that keeps
holding gets the engine's ``K``, and a verification that is likely to keep little costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NUM_BUCKETS", "AcceptanceModel", "Tally", "bucket"]

#: run-length buckets: 1, 2-3, 4-7, 8-15, 16-31, 32 and more tokens
NUM_BUCKETS = 6
#: the longest run worth measuring: every longer run is in the last bucket
MAX_RUN = 1 << (NUM_BUCKETS - 1)
#: before any trial, the chance that a copy of ``r`` tokens goes on: odds of ``r`` to 1 (``r`` the bucket's
#: shortest run); that an opening after a match of ``r`` tokens holds: odds of ``r / 2`` to 1 (a fresh match
#: is a weaker sign than a copy that held). Each weighs as two trials in the workload's estimate.
PRIOR_MEAN = [r / (r + 1) for r in [(1 << b) / 2 for b in range(NUM_BUCKETS)] + [1 << b for b in range(NUM_BUCKETS)]]
#: how many trials the workload's estimate weighs in a request's own
PRIOR_TRIALS = 4.0
#: trials a bucket's counts hold before they are halved: recent verifications count more than old ones
REQUEST_WINDOW, WORKLOAD_WINDOW = 32.0, 256.0


def bucket(run: int) -> int:
    """The bucket of a run of ``run`` >= 1 tokens."""
    return min(NUM_BUCKETS - 1, run.bit_length() - 1)


def _slot(run: int, is_opening: bool) -> int:
    return bucket(min(run, MAX_RUN)) + (0 if is_opening else NUM_BUCKETS)


@dataclass
class Tally:
    """Drafts kept and drafts tried (a trial: one draft whose predecessors were kept), per kind and bucket:
    openings in slots ``0 .. NUM_BUCKETS - 1``, continuing drafts after them."""

    kept: list[float] = field(default_factory=lambda: [0.0] * 2 * NUM_BUCKETS)
    tried: list[float] = field(default_factory=lambda: [0.0] * 2 * NUM_BUCKETS)

    def add(self, slot: int, kept: bool, window: float) -> None:
        self.kept[slot] += kept
        self.tried[slot] += 1
        if self.tried[slot] > window:
            self.kept[slot] /= 2
            self.tried[slot] /= 2


class AcceptanceModel:
    def __init__(self, draft_cost: float) -> None:
        self.draft_cost = draft_cost
        self.workload = Tally()

    def probabilities(self, tally: Tally, run: int, limit: int, is_opening: bool) -> list[float]:
        """``p`` of drafts 1 .. ``limit`` of a proposal continuing a match of ``run`` tokens (``is_opening``: a
        fresh match, not the copy the last proposal followed): each slot's estimate, and at least that of the
        slot the proposal starts in (a copy that held on is no less likely to go on)."""
        w, p, floor = self.workload, [], 0.0
        for i in range(limit):
            s = _slot(run + i, is_opening and i == 0)
            prior = (w.kept[s] + 2 * PRIOR_MEAN[s]) / (w.tried[s] + 2)
            floor = max(floor, (tally.kept[s] + PRIOR_TRIALS * prior) / (tally.tried[s] + PRIOR_TRIALS))
            p.append(floor)
        return p

    def num_drafts(self, tally: Tally, run: int, limit: int, is_opening: bool) -> int:
        """The number of drafts (0 .. ``limit``) with the best expected tokens per cost; 0 when none beats a
        plain step."""
        best, best_ratio, tokens, chain = 0, 1.0, 1.0, 1.0
        for k, p in enumerate(self.probabilities(tally, run, limit, is_opening), 1):
            chain *= p
            tokens += chain
            ratio = tokens / (1 + self.draft_cost * k)
            if ratio > best_ratio:
                best, best_ratio = k, ratio
        return best

    def record(self, tally: Tally, run: int, num_proposed: int, num_accepted: int, is_opening: bool) -> None:
        """Count one verification: drafts 1 .. ``num_accepted`` kept, the next one (if any) rejected."""
        for i in range(min(num_accepted + 1, num_proposed)):
            s, kept = _slot(run + i, is_opening and i == 0), i < num_accepted
            tally.add(s, kept, REQUEST_WINDOW)
            self.workload.add(s, kept, WORKLOAD_WINDOW)
