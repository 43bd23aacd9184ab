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

How many drafts, and when a request stops drafting: :mod:`kvcore.speculative.backoff` (adaptive length up to
the engine's ``K``; ``misses`` verifications in a row that keep nothing back the request off for
``cooldown`` steps, doubling; a backed-off request probes with one draft, and only on a ``max_n``-token
match). So a free-form stream, whose n-grams rarely repeat, decodes as without speculation: a step without
drafts is a plain one-token decode step. The defaults are the best of a grid replayed on recorded greedy streams
(benchmarks/studies/speculative_replay.py): a short first back-off that doubles keeps the short copies of a paraphrasing
answer, and costs a free-form stream no more than a long one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer
from kvcore.speculative.backoff import Backoff, DraftLength, check_positive

#: the longest n-gram ``max_n`` may ask for: the index keeps ``max_n - min_n + 1`` tuples of up to ``max_n`` tokens
#: per token of context, and a step costs O(``max_n``) lookups, so memory and time grow with it; copies are found
#: by 2- to 4-grams (llama.cpp's lookup stops at 4), and a larger bound only lets a config file hang a request
MAX_NGRAM = 16


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)  # what the index covers: the request's tokens so far
    #: per n: n-gram -> where the tokens after its latest occurrence start
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    length: DraftLength = field(default_factory=DraftLength)
    #: the last proposal's source: (where its drafts started in ``tokens``, len(tokens) then)
    source: tuple[int, int] | None = None


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: the continuation of the longest repeated n-gram; adaptive length, backs off"

    def __init__(self, max_n: int = 3, min_n: int = 2, misses: int = 3, cooldown: int = 2) -> None:
        super().__init__()
        check_positive("ngram", max_n=max_n, min_n=min_n, misses=misses, cooldown=cooldown)
        if max_n > MAX_NGRAM:
            raise ConfigError(f"proposer 'ngram': max_n must be in [1, {MAX_NGRAM}], got {max_n}")
        if min_n > max_n:
            raise ConfigError(f"proposer 'ngram': min_n ({min_n}) is larger than max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.backoff = Backoff(misses, cooldown)
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
            num = self.backoff.drafts(state.length, k)
            out.append(Proposal(self._lookup(state, num, self.max_n if state.length.probing else self.min_n)
                                if num else []))
        return out

    def _lookup(self, state: _State, k: int, min_n: int) -> list[int]:
        tokens, start = state.tokens, self._followed(state)
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            if start is not None:
                break
            start = state.index.get(n, {}).get(tuple(tokens[-n:]))
        if start is None:
            state.source = None
            return []
        state.source = (start, len(tokens))
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
            self.backoff.advance(state.length, num_proposed, num_accepted)


@hookimpl
def kvcore_register_proposers(register):
    register(NgramProposer)
