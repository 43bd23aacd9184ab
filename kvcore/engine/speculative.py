"""Speculative decoding in the engine: which requests speculate, how many drafts each may take, and the
checks that refuse an engine that cannot verify drafts (with the reason).

A step whose rows are all decoding asks the proposer for drafts; :mod:`kvcore.engine.verify` scores them
(one multi-token decode row per request) and keeps what the acceptance rules of
:mod:`kvcore.sampling.speculative` allow. A step that carries prompt chunks decodes one token per row, as
without speculation. See docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.errors import ConfigError, PluginError
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerTarget
from kvcore.loaders.model_cache import load_pretrained
from kvcore.scheduling.request import EngineStats, Request

__all__ = ["Speculator", "DraftView", "speculator_for"]


@dataclass(frozen=True)
class DraftView:
    """A request as the sampler sees it at one draft position: its output extended by the drafts before it
    (a :class:`~kvcore.interfaces.sampler.SamplingRow`, so penalties and seeded draws see that history)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: Any
    seed: int


def reasons_refused(config: Any, backends: tuple[AttentionBackend, ...], tensor_parallel: bool) -> list[str]:
    """Why this engine cannot verify draft tokens ([] = it can)."""
    reasons = [f"backend '{b.name}' does not declare multi-token decode (capabilities.multi_token_decode)"
               for b in dict.fromkeys(backends) if not b.capabilities.multi_token_decode]
    if tensor_parallel:
        reasons.append("verification runs in one process (tensor_parallel_size must be 1)")
    return reasons


def speculator_for(engine: Any, registry: Any) -> Speculator | None:
    """The engine's :class:`Speculator` (None without ``config.proposer``); a ConfigError with every reason
    when the engine or the proposer cannot do it."""
    config = engine.config
    if config.proposer is None:
        return None
    name = config.proposer
    reasons = reasons_refused(config, (engine.prefill_backend, engine.decode_backend), config.tensor_parallel_size > 1)
    proposer = registry.create_proposer(name, config.proposer_options.get(name))
    if not reasons:
        target = ProposerTarget(
            vocab_size=engine.model.config.vocab_size, dtype=engine.dtype, device=engine.device,
            max_model_len=engine.max_model_len, max_num_seqs=config.max_num_seqs, model=engine.model,
            tokenizer=engine.tokenizer, load_model=lambda spec: load_pretrained(
                spec, engine.dtype, engine.device, engine.max_model_len, None, config.weights),
        )
        try:
            reasons = list(proposer.bind(target))
        except ConfigError:
            raise
        except Exception as exc:
            raise PluginError(f"proposer '{name}' failed to bind: {type(exc).__name__}: {exc}") from exc
    if reasons:
        raise ConfigError(f"speculative decoding with proposer '{name}' cannot run: {'; '.join(reasons)}")
    return Speculator(proposer, config.num_speculative_tokens, engine.stats)


class Speculator:
    """The engine's side of a proposer: the per-request lifecycle, the draft budget, the counters."""

    def __init__(self, proposer: Proposer, num_tokens: int, stats: EngineStats) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens  # K: drafts per request and step, at most
        self.stats = stats
        self._started: set[str] = set()

    def budget(self, req: Request, max_model_len: int, max_seq_len: int) -> int:
        """Drafts ``req`` may take this step: K, fewer where they would outrun ``max_new_tokens`` or the
        context (a step emits up to drafts + 1 tokens)."""
        left = min(req.params.max_new_tokens - len(req.output_ids), max_model_len - req.num_tokens) - 1
        return max(0, min(self.num_tokens, left, max_seq_len - req.num_tokens))

    def propose(self, reqs: list[Request], budgets: list[int], vocab_size: int) -> list[Proposal]:
        """One checked proposal per request (empty where its budget is 0)."""
        for req in reqs:
            if req.request_id not in self._started:
                self._started.add(req.request_id)
                self.proposer.start(req.request_id, req.all_ids)
        asked = [i for i, b in enumerate(budgets) if b > 0]
        out = [Proposal()] * len(reqs)
        if not asked:
            return out
        name = self.proposer.name
        try:
            got = self.proposer.propose([reqs[i] for i in asked], [budgets[i] for i in asked])
        except Exception as exc:
            raise PluginError(f"proposer '{name}' failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(got, list) or len(got) != len(asked) or not all(isinstance(p, Proposal) for p in got):
            raise PluginError(f"proposer '{name}' must return one Proposal per row ({len(asked)})")
        for i, proposal in zip(asked, got):
            ids = list(proposal.token_ids)
            if len(ids) > budgets[i] or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
                raise PluginError(f"proposer '{name}' proposed {ids[:8]} for at most {budgets[i]} tokens in a "
                                  f"vocabulary of {vocab_size}")
            probs = proposal.probs
            if probs is not None and tuple(probs.shape) != (len(ids), vocab_size):
                raise PluginError(f"proposer '{name}' returned probs of shape {tuple(probs.shape)}, expected "
                                  f"({len(ids)}, {vocab_size})")
            out[i] = Proposal(ids, probs if ids else None)
        return out

    def advance(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """Count one verification of ``req``'s drafts and tell the proposer."""
        m = req.metrics
        m.num_spec_steps += 1
        m.num_draft_tokens += num_proposed
        m.num_accepted_tokens += num_accepted
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        self.proposer.advance(req.request_id, num_proposed, num_accepted)

    def finish(self, req: Request) -> None:
        if req.request_id in self._started:
            self._started.discard(req.request_id)
            self.proposer.finish(req.request_id)
