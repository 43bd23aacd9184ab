"""``ngram``: prompt-lookup speculation (llama.cpp's ``llama-lookup``, vLLM's ``ngram``): no second model.

When the last ``n`` tokens of a request (the longest ``n`` from ``max_n`` down to ``min_n``) occurred before in
its prompt or output, the tokens that followed their latest occurrence are proposed (a copy that reaches the
end of the stream goes on with its own drafts, as a periodic stream continues). Strong where the answer
copies its input: summaries, code edits, retrieval-grounded answers.

The lookup is incremental: an index from each n-gram to where the tokens after its latest occurrence start,
extended by the tokens that arrived since the last step; a step costs O(``max_n``) dictionary operations,
whatever the context length.

A copy in progress is followed without a new search: when the stream went on as the source of the last
proposal did (its last ``max_n`` tokens are the ones before the next source position), the next drafts
continue that source, even where its n-gram also occurs later elsewhere (repeated lines of code, a list
whose items start alike); otherwise the index gives the latest occurrence of the longest match.

How many drafts: as many as the match is expected to earn (:mod:`kvcore.backends.acceptance`): the match's
length, checked against the actual tokens (up to 32), and how well matches of that length held in this request
and in the workload give each draft's chance to be kept; the length with the best expected tokens per cost of
a verification is proposed (``draft_cost``: a draft row's cost in plain decode steps), none where no length
beats a plain step. So a short or unreliable match proposes one or two drafts and a copy that keeps holding
the engine's ``K``. When a request stops drafting: :mod:`kvcore.backends.backoff` (``misses`` verifications in
a row that keep nothing back the request off for ``cooldown`` steps, doubling; a backed-off request probes
with one draft, and only on a ``max_n``-token match). So a free-form stream, whose n-grams rarely repeat,
decodes as without speculation: a step without drafts is a plain one-token decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer

from .acceptance import MAX_RUN, AcceptanceModel, Tally
from .backoff import Backoff, DraftLength, check_positive


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)  # what the index covers: the request's tokens so far
    #: per n: n-gram -> where the tokens after its latest occurrence start
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    length: DraftLength = field(default_factory=DraftLength)  # the back-off
    tally: Tally = field(default_factory=Tally)  # how this request's matches held, by length
    #: the last proposal's source: (where its drafts started in ``tokens``, len(tokens) then, the match's length,
    #: whether it was a fresh match rather than the copy followed)
    source: tuple[int, int, int, bool] | None = None


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: the continuation of the longest repeated n-gram, as long as it is worth; backs off"

    def __init__(self, max_n: int = 4, min_n: int = 2, misses: int = 8, cooldown: int = 16,
                 draft_cost: float = 0.15) -> None:
        super().__init__()
        check_positive("ngram", max_n=max_n, min_n=min_n, misses=misses, cooldown=cooldown)
        if min_n > max_n:
            raise ConfigError(f"proposer 'ngram': min_n ({min_n}) is larger than max_n ({max_n})")
        if isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float)) or not 0 < draft_cost < 1:
            raise ConfigError(f"proposer 'ngram': draft_cost must be a number between 0 and 1 (a draft row's cost "
                              f"in plain decode steps), got {draft_cost!r}")
        self.max_n, self.min_n = max_n, min_n
        self.backoff = Backoff(misses, cooldown)
        self.acceptance = AcceptanceModel(float(draft_cost))
        self._states: dict[str, _State] = {}

    def start(self, request_id, token_ids) -> None:
        self._states[request_id] = _State()

    def finish(self, request_id) -> None:
        self._states.pop(request_id, None)

    def _catch_up(self, state: _State, prompt: list[int], output: list[int]) -> None:
        """Index the tokens that arrived since the last call (O(new tokens)); a history that is not an
        extension of the indexed one (which a request never has) is indexed anew."""
        done, num_prompt = len(state.tokens), len(prompt)
        if done > num_prompt + len(output) or (done and state.tokens[-1] != (
                prompt[done - 1] if done <= num_prompt else output[done - 1 - num_prompt])):
            state.tokens, state.index, done = [], {}, 0
        tokens = state.tokens
        tokens += prompt[done:] if done < num_prompt else []
        tokens += output[max(0, done - num_prompt) :]
        for n in range(self.min_n, self.max_n + 1):
            table = state.index.setdefault(n, {})
            for end in range(max(n, done), len(tokens)):  # tokens[end] follows tokens[end - n : end]
                table[tuple(tokens[end - n : end])] = end

    def propose(self, rows, num_tokens) -> list[Proposal]:
        out = []
        for row, k in zip(rows, num_tokens):
            state = self._states.setdefault(row.request_id, _State())
            self._catch_up(state, row.prompt_ids, row.output_ids)
            limit = self.backoff.limit(state.length, k)
            out.append(Proposal(self._lookup(state, limit, self.max_n if state.length.probing else self.min_n)
                                if limit else []))
        return out

    def _lookup(self, state: _State, limit: int, min_n: int) -> list[int]:
        """Up to ``limit`` drafts continuing the copy in progress or the longest match (of ``min_n`` tokens at
        least), as many as the match is expected to earn."""
        tokens, start = state.tokens, self._followed(state)
        is_opening = start is None
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            if start is not None:
                break
            start = state.index.get(n, {}).get(tuple(tokens[-n:]))
        state.source = None
        if start is None:
            return []
        run = _match_length(tokens, start)
        k = self.acceptance.num_drafts(state.tally, run, limit, is_opening)
        if k == 0:
            return []
        state.source = (start, len(tokens), run, is_opening)
        drafts, period = tokens[start : start + k], len(tokens) - start
        while len(drafts) < k:  # a copy that runs past the end repeats its own drafts (a periodic stream)
            drafts.append(drafts[len(drafts) - period])
        return drafts

    def _followed(self, state: _State) -> int | None:
        """Where the last proposal's source goes on, if the stream went on as it did (its last ``max_n``
        tokens precede that position); else None."""
        if state.source is None:
            return None
        tokens, n = state.tokens, self.max_n
        start = state.source[0] + len(tokens) - state.source[1]
        if n <= start < len(tokens) and tokens[start - n : start] == tokens[-n:]:
            return start
        return None

    def advance(self, request_id, num_proposed, num_accepted) -> None:
        state = self._states.get(request_id)
        if state is not None:
            if state.source is not None and num_proposed:
                _, _, run, is_opening = state.source
                self.acceptance.record(state.tally, run, num_proposed, num_accepted, is_opening)
            self.backoff.advance(state.length, num_proposed, num_accepted)


def _match_length(tokens: list[int], start: int) -> int:
    """How many tokens before ``start`` equal the stream's last ones (up to :data:`MAX_RUN`): the match
    checked against the tokens themselves."""
    run, end = 0, len(tokens)
    while run < min(start, MAX_RUN) and tokens[start - 1 - run] == tokens[end - 1 - run]:
        run += 1
    return run


@hookimpl
def kvcore_register_proposers(register):
    register(NgramProposer)
