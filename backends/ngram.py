"""``ngram``: prompt-lookup speculation (llama.cpp's ``llama-lookup``, vLLM's ``ngram``): no second model.

When the last ``n`` tokens of a request (``n`` from ``max_n`` down to ``min_n``) occurred before in its prompt
or output, the tokens that followed their latest occurrence are proposed. Strong where the answer copies
its input: summaries, code edits, retrieval-grounded answers.

Back-off: every verified proposal updates a moving average of the fraction of drafts kept. Below
``min_acceptance`` the request proposes nothing for ``cooldown`` steps, then tries once more; above it, it
proposes about ``K × acceptance`` tokens. So a free-form stream, whose n-grams rarely repeat, soon decodes as
without speculation and pays for scoring wrong drafts only on the rare probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer

#: weight of the newest verification in the moving acceptance average
EMA_WEIGHT = 0.3


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)  # what the index covers
    #: per n: n-gram -> where the tokens after its latest occurrence start
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    acceptance: float = 1.0  # moving average of kept / proposed drafts (optimistic start)
    cooldown: int = 0  # steps left without proposing


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: the continuation of the last n-gram's latest earlier occurrence; backs off"

    def __init__(self, max_n: int = 4, min_n: int = 2, min_acceptance: float = 0.25, cooldown: int = 16) -> None:
        super().__init__()
        for key, value in (("max_n", max_n), ("min_n", min_n), ("cooldown", cooldown)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "cooldown" else 1):
                raise ConfigError(f"proposer 'ngram': {key} must be a positive integer, got {value!r}")
        if min_n > max_n:
            raise ConfigError(f"proposer 'ngram': min_n ({min_n}) is larger than max_n ({max_n})")
        if not isinstance(min_acceptance, (int, float)) or not 0 <= min_acceptance <= 1:
            raise ConfigError(f"proposer 'ngram': min_acceptance must be in [0, 1], got {min_acceptance!r}")
        self.max_n, self.min_n = max_n, min_n
        self.min_acceptance, self.cooldown = float(min_acceptance), cooldown
        self._states: dict[str, _State] = {}

    def start(self, request_id, token_ids) -> None:
        self._states[request_id] = _State()

    def finish(self, request_id) -> None:
        self._states.pop(request_id, None)

    def _index(self, state: _State, tokens: list[int]) -> None:
        """Extend the index with the n-grams that now have a following token (a rewritten history, which a
        request never has, is indexed anew)."""
        done = len(state.tokens)
        if tokens[:done] != state.tokens:
            state.tokens, state.index, done = [], {}, 0
        for n in range(self.min_n, self.max_n + 1):
            table = state.index.setdefault(n, {})
            for end in range(max(n, done), len(tokens)):  # tokens[end] follows tokens[end - n : end]
                table[tuple(tokens[end - n : end])] = end
        state.tokens = list(tokens)

    def propose(self, rows, num_tokens) -> list[Proposal]:
        out = []
        for row, k in zip(rows, num_tokens):
            state = self._states.setdefault(row.request_id, _State())
            tokens = row.prompt_ids + row.output_ids
            self._index(state, tokens)
            if state.cooldown > 0:
                state.cooldown -= 1
                out.append(Proposal())
                continue
            k = max(1, min(k, math.ceil(k * state.acceptance)))
            out.append(Proposal(self._lookup(state, tokens, k)))
        return out

    def _lookup(self, state: _State, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = state.index.get(n, {}).get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def advance(self, request_id, num_proposed, num_accepted) -> None:
        state = self._states.get(request_id)
        if state is None or num_proposed == 0:
            return
        state.acceptance += EMA_WEIGHT * (num_accepted / num_proposed - state.acceptance)
        if state.acceptance < self.min_acceptance:
            state.cooldown = self.cooldown
            state.acceptance = self.min_acceptance  # the probe after the cooldown starts from the threshold


@hookimpl
def kvcore_register_proposers(register):
    register(NgramProposer)
