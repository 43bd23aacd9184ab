"""``ngram``: prompt-lookup speculation (llama.cpp's ``llama-lookup``, vLLM's ``ngram``): no second model.

When the last ``n`` tokens of a request (the longest ``n`` from ``max_n`` down to ``min_n``) occurred before in
its prompt or output, the tokens that followed their latest occurrence are proposed (a copy that reaches the
end of the stream goes on with its own drafts, as a periodic stream continues). Strong where the answer
copies its input: summaries, code edits, retrieval-grounded answers.

The lookup is incremental: an index from each n-gram to where the tokens after its latest occurrence start,
extended by the tokens that arrived since the last step; a step costs O(``max_n``) dictionary operations,
whatever the context length.

How many drafts (adaptive, at most the engine's ``K``): all drafts kept doubles the next proposal; a rejection
makes it one more than were kept (the length that would have been right, plus one to find out more).

Back-off: ``misses`` verifications in a row that keep nothing make the request propose nothing for
``cooldown`` steps, doubling with each back-off that follows without a kept draft in between. A request that
has backed off probes only on a ``max_n``-token match, with one draft; a probe that misses backs off again.
So a free-form stream, whose n-grams rarely repeat, decodes as without speculation: a step without drafts
is a plain one-token decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer

#: the longest cooldown a request backs off for, in steps
MAX_COOLDOWN = 1024


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)  # what the index covers: the request's tokens so far
    #: per n: n-gram -> where the tokens after its latest occurrence start
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    num_drafts: int | None = None  # drafts to propose next (None: the engine's K)
    num_misses: int = 0  # verifications in a row that kept nothing
    num_backoffs: int = 0  # back-offs since the last kept draft
    cooldown: int = 0  # steps left without proposing


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: the continuation of the longest repeated n-gram; adaptive length, backs off"

    def __init__(self, max_n: int = 4, min_n: int = 2, misses: int = 2, cooldown: int = 16) -> None:
        super().__init__()
        for key, value in (("max_n", max_n), ("min_n", min_n), ("misses", misses), ("cooldown", cooldown)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"proposer 'ngram': {key} must be a positive integer, got {value!r}")
        if min_n > max_n:
            raise ConfigError(f"proposer 'ngram': min_n ({min_n}) is larger than max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.misses, self.cooldown = misses, cooldown
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
            if state.cooldown > 0:
                state.cooldown -= 1
                out.append(Proposal())
                continue
            probing = state.num_backoffs > 0
            num = 1 if probing else min(k, state.num_drafts or k)
            out.append(Proposal(self._lookup(state, num, self.max_n if probing else self.min_n)))
        return out

    def _lookup(self, state: _State, k: int, min_n: int) -> list[int]:
        tokens = state.tokens
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            start = state.index.get(n, {}).get(tuple(tokens[-n:]))
            if start is not None:  # a copy that runs past the end repeats its own drafts (a periodic stream)
                drafts, period = tokens[start : start + k], len(tokens) - start
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []

    def advance(self, request_id, num_proposed, num_accepted) -> None:
        state = self._states.get(request_id)
        if state is None or num_proposed == 0:
            return
        if num_accepted == num_proposed:
            state.num_drafts = 2 * num_proposed
        else:
            state.num_drafts = num_accepted + 1
        if num_accepted > 0:
            state.num_misses = state.num_backoffs = 0
            return
        state.num_misses += 1
        if state.num_misses >= self.misses or state.num_backoffs > 0:  # a failed probe backs off at once
            state.cooldown = min(MAX_COOLDOWN, self.cooldown << state.num_backoffs)
            state.num_misses, state.num_backoffs = 0, state.num_backoffs + 1


@hookimpl
def kvcore_register_proposers(register):
    register(NgramProposer)
