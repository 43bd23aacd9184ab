"""The proposers the speculative tier verifies with: each pushes verification down another path.

* ``conformance-oracle``: the true continuation (from a run without speculation): every draft is kept, so
  each verification must yield ``K + 1`` tokens (a dropped bonus token shows as fewer).
* ``conformance-reject-all``: a token that is never the next one: every draft is rejected, so the KV cache
  must go back every step (stale draft K/V shows as a wrong stream).
* ``conformance-random``: random tokens, seeded per request and step; with ``sampled = true`` drawn from a
  random distribution ``q`` it reports (``Proposal.probs``), the path of the rejection rule ``min(1, p/q)``.
"""

from __future__ import annotations

import math
import types
import zlib

import torch

from kvcore.hookspecs import hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerCapabilities

__all__ = ["ORACLE", "REJECT_ALL", "RANDOM", "plugin"]

ORACLE, REJECT_ALL, RANDOM = "conformance-oracle", "conformance-reject-all", "conformance-random"


def _key(prompt_ids) -> str:
    return ",".join(map(str, prompt_ids))


class OracleProposer(Proposer):
    name = ORACLE
    description = "the true continuation (conformance)"

    def __init__(self, continuations: dict[str, list[int]], wrong: bool = False) -> None:
        super().__init__()
        self.continuations, self.wrong = continuations, wrong

    def bind(self, target) -> list[str]:
        self.vocab_size = target.vocab_size
        return []

    def propose(self, rows, num_tokens):
        out = []
        for row, k in zip(rows, num_tokens):
            truth = self.continuations.get(_key(row.prompt_ids), [])[len(row.output_ids):][:k]
            if self.wrong:  # one draft that is never the next token
                truth = [(t + 1) % self.vocab_size for t in truth[:1]]
            out.append(Proposal(truth))
        return out


class RejectAllProposer(OracleProposer):
    name = REJECT_ALL
    description = "a token that is never the next one (conformance)"

    def __init__(self, continuations: dict[str, list[int]]) -> None:
        super().__init__(continuations, wrong=True)


class RandomProposer(Proposer):
    name = RANDOM
    description = "random drafts, seeded per request and step; optionally drawn from a reported q (conformance)"
    capabilities = ProposerCapabilities(deterministic=False)

    def __init__(self, seed: int = 0, sampled: bool = False, support: list[int] | None = None) -> None:
        super().__init__()
        self.seed, self.sampled, self.support = seed, sampled, support  # support: the ids q may put mass on

    def bind(self, target) -> list[str]:
        self.vocab_size = target.vocab_size
        return []

    def propose(self, rows, num_tokens):
        out = []
        for row, k in zip(rows, num_tokens):
            key = f"{self.seed}|{row.request_id}|{len(row.output_ids)}".encode()
            gen = torch.Generator().manual_seed(zlib.crc32(key))
            num = int(torch.randint(0, k + 1, (), generator=gen))
            if not self.sampled:
                out.append(Proposal(torch.randint(0, self.vocab_size, (num,), generator=gen).tolist()))
                continue
            scores = torch.randn(num, self.vocab_size, generator=gen, dtype=torch.float64) * 3
            if self.support is not None:
                outside = torch.ones(self.vocab_size, dtype=torch.bool)
                outside[self.support] = False
                scores[:, outside] = -math.inf
            q = scores.softmax(-1)
            ids = torch.multinomial(q, 1, generator=gen)[:, 0].tolist() if num else []
            out.append(Proposal(ids, q))
        return out


def plugin() -> types.ModuleType:
    """A plugin module registering the three (``registry.register_plugin(plugin())``)."""
    module = types.ModuleType("kvcore_conformance_proposers")

    @hookimpl
    def kvcore_register_proposers(register):
        for cls in (OracleProposer, RejectAllProposer, RandomProposer):
            register(cls)

    module.kvcore_register_proposers = kvcore_register_proposers
    return module
