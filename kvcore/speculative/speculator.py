"""The engine's side of a proposer: which requests speculate, how many drafts each may take, the checks on
what a proposer returns, and the refusals of an engine that cannot verify drafts (with the reason).

A step whose rows are all decoding asks the :class:`Speculator` for drafts; :mod:`kvcore.engine.verify` scores
them (one multi-token decode row per request) and keeps what the acceptance rules of
:mod:`kvcore.sampling.rejection` allow. A step that carries prompt chunks decodes one token per row, as
without speculation. See docs/speculative.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvcore.errors import ConfigError, PluginError
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.proposer import Proposal, Proposer, ProposerTarget
from kvcore.loaders.model_cache import load_pretrained
from kvcore.plugins.registry import PluginRegistry
from kvcore.scheduling.request import EngineStats, Request

__all__ = ["Speculator", "speculator_for"]

logger = logging.getLogger(__name__)


def reasons_refused(backends: tuple[AttentionBackend, ...], tensor_parallel: bool) -> list[str]:
    """Why this engine cannot verify draft tokens ([] = it can)."""
    reasons = [f"backend '{b.name}' does not declare multi-token decode (capabilities.multi_token_decode)"
               for b in dict.fromkeys(backends) if not b.capabilities.multi_token_decode]
    if tensor_parallel:
        reasons.append("verification runs in one process (tensor_parallel_size must be 1)")
    return reasons


def speculator_for(engine: Any, registry: PluginRegistry) -> Speculator | None:
    """The engine's :class:`Speculator` (None without ``config.proposer``); a ConfigError with every reason
    when the engine or the proposer cannot do it."""
    config = engine.config
    if config.proposer is None:
        return None
    name = config.proposer
    loaded: list[Any] = []  # the decoders the proposer loads: the engine watches their files as the target's

    def load_model(spec: str, weights: str | None = None) -> tuple[Any, Any]:
        model, tokenizer = load_pretrained(spec, engine.dtype, engine.device, engine.max_model_len, None,
                                           weights or config.weights, lm_head="int4")  # a draft's own head
        loaded.append(model)
        return model, tokenizer

    reasons = reasons_refused((engine.prefill_backend, engine.decode_backend), config.tensor_parallel_size > 1)
    proposer = registry.create_proposer(name, config.proposer_options.get(name))
    if not reasons:
        target = ProposerTarget(
            vocab_size=engine.model.config.vocab_size, dtype=engine.dtype, device=engine.device,
            max_model_len=engine.max_model_len, max_num_seqs=config.max_num_seqs, model=engine.model,
            tokenizer=engine.tokenizer, load_model=load_model, lm_head=engine.lm_head,
        )
        try:
            reasons = list(proposer.bind(target))
        except ConfigError:
            raise
        except Exception as exc:
            raise PluginError(f"proposer '{name}' failed to bind: {type(exc).__name__}: {exc}") from exc
    if reasons:
        raise ConfigError(f"speculative decoding with proposer '{name}' cannot run: {'; '.join(reasons)}")
    return Speculator(proposer, config.num_speculative_tokens, engine.stats, loaded)


class Speculator:
    """The engine's side of a proposer: the per-request lifecycle, the draft budget, the counters."""

    def __init__(self, proposer: Proposer, num_tokens: int, stats: EngineStats, models: list[Any]) -> None:
        self.proposer = proposer
        #: the decoders the proposer loaded (:attr:`ProposerTarget.load_model`), e.g. a draft model: their weight
        #: files are watched as the target's (:meth:`kvcore.engine.core.Engine.model_problem`)
        self.models = models
        self.num_tokens = num_tokens  # K: drafts per request and step, at most
        self.stats = stats
        self._started: dict[str, int] = {}  # request id -> its preemptions when the proposer started it

    def budget(self, req: Request, max_model_len: int, max_seq_len: int) -> int:
        """Drafts ``req`` may take this step: K, fewer where they would outrun ``max_new_tokens`` or the
        context (a step emits up to drafts + 1 tokens)."""
        left = min(req.params.max_new_tokens - len(req.output_ids), max_model_len - req.num_tokens) - 1
        return max(0, min(self.num_tokens, left, max_seq_len - req.num_tokens))

    def release(self, waiting: Iterable[Request]) -> None:
        """Finish the proposer's state of the requests among ``waiting`` it started (preempted ones), so that
        it (a draft model's cache rows) is not held while they wait; they start again when they decode. One
        preempted and re-admitted within a step is finished and started again at its next proposal."""
        for req in waiting:
            self.finish(req)

    def propose(self, reqs: list[Request], budgets: list[int], vocab_size: int
                ) -> tuple[list[Proposal], dict[int, PluginError]]:
        """One checked proposal per request (empty where its budget is 0), and the rows whose proposal was
        refused, with the reason (their proposals are empty). A proposer that raises fails the whole call.

        The proposer reads the engine's own requests: one that changed a request's tokens (wrote its drafts
        into ``output_ids``, say) has them put back to their lengths and fails that request. Left alone, a
        sequence grown past its limits is one the scheduler can never run again: the engine would loop."""
        name = self.proposer.name
        marks = [_mark(req) for req in reqs]
        try:
            for req in reqs:
                if self._started.get(req.request_id, req.metrics.num_preemptions) != req.metrics.num_preemptions:
                    self.finish(req)  # preempted since it started (and back before a step saw it wait)
                if req.request_id not in self._started:
                    self.proposer.start(req.request_id, req.all_ids)
                    self._started[req.request_id] = req.metrics.num_preemptions
            asked = [i for i, b in enumerate(budgets) if b > 0]
            got = self.proposer.propose([reqs[i] for i in asked], [budgets[i] for i in asked]) if asked else []
        except Exception as exc:
            raise PluginError(f"proposer '{name}' failed: {type(exc).__name__}: {exc}") from exc
        finally:
            changed = {i: reason for i, (req, mark) in enumerate(zip(reqs, marks)) if (reason := _restore(req, mark))}
        if not isinstance(got, list) or len(got) != len(asked) or not all(isinstance(p, Proposal) for p in got):
            raise PluginError(f"proposer '{name}' must return one Proposal per row ({len(asked)}), "
                              f"got {_shown(got)}")
        out, refused = [Proposal()] * len(reqs), {}
        for i, proposal in zip(asked, got):
            reason = _refusal(proposal, budgets[i], vocab_size)
            if reason:
                refused[i] = PluginError(f"proposer '{name}' {reason}")
            else:
                out[i] = Proposal(list(proposal.token_ids), proposal.probs if proposal.token_ids else None)
        for i, reason in changed.items():
            out[i], refused[i] = Proposal(), PluginError(f"proposer '{name}' {reason}")
        return out, refused

    def advance(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """Count one verification of ``req``'s drafts (``num_accepted``: the drafts it emitted) and tell the
        proposer, unless the request ended in this step (the proposer has already finished it)."""
        m = req.metrics
        m.num_spec_steps += 1
        m.num_draft_tokens += num_proposed
        m.num_accepted_tokens += num_accepted
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        if req.request_id in self._started:
            self._call("advance", self.proposer.advance, req.request_id, num_proposed, num_accepted)

    def finish(self, req: Request) -> None:
        """Tell the proposer ``req`` ended here; a proposer that fails to is logged (what the request got stands)."""
        if self._started.pop(req.request_id, None) is not None:
            try:
                self._call("finish", self.proposer.finish, req.request_id)
            except PluginError as exc:
                logger.warning("%s", exc)

    def _call(self, what: str, method: Callable[..., None], *args: str | int) -> None:
        try:
            method(*args)
        except Exception as exc:
            raise PluginError(f"proposer '{self.proposer.name}' failed in {what}: {type(exc).__name__}: {exc}"
                              ) from exc


#: how far a draft distribution's sum may be from 1 (float32 softmax rounding over a large vocabulary)
_PROBS_SUM_TOL = 1e-3


_Mark = tuple[list[int], int, list[int], int, list[int]]


def _mark(req: Request) -> _Mark:
    """What :func:`_restore` checks a request's tokens against: its two lists, their lengths, the last token."""
    return req.prompt_ids, len(req.prompt_ids), req.output_ids, len(req.output_ids), req.output_ids[-1:]


def _restore(req: Request, mark: _Mark) -> str:
    """Why ``req``'s tokens are not as ``mark`` found them ('' = they are), after putting back its lists at
    their lengths (a proposer's appended drafts go; tokens it overwrote or removed cannot come back)."""
    prompt, num_prompt, output, num_output, last = mark
    now = (len(req.prompt_ids), len(req.output_ids))
    same_lists = req.prompt_ids is prompt and req.output_ids is output
    if same_lists and now == (num_prompt, num_output) and output[-1:] == last:
        return ""
    what = [f"{part} {was} -> {n} tokens" for part, was, n in (("prompt", num_prompt, now[0]),
                                                               ("output", num_output, now[1])) if was != n]
    if req.prompt_ids is not prompt or req.output_ids is not output:
        what.append("its token lists replaced")
    req.prompt_ids, req.output_ids = prompt, output
    del prompt[num_prompt:], output[num_output:]
    return (f"changed request '{req.request_id}' ({', '.join(what) or 'its last token overwritten'}): the rows "
            "a proposer gets are read only, its drafts go in the Proposal it returns")


def _shown(value: object) -> str:
    """A short description of what a plugin returned, for an error message."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _refusal(proposal: Proposal, budget: int, vocab_size: int) -> str:
    """Why a row's proposal cannot be verified ('' = it can): drafts must be at most ``budget`` token ids of the
    vocabulary, and ``probs`` (when given) one probability distribution per draft, finite, >= 0, summing to 1."""
    ids = proposal.token_ids
    if not isinstance(ids, (list, tuple)):
        return f"returned token_ids of {_shown(ids)}, expected a list of token ids"
    if len(ids) > budget:
        return (f"proposed {len(ids)} drafts {list(ids[:8])}{' ...' if len(ids) > 8 else ''} where at most "
                f"{budget} were asked for (num_tokens: what the request may still take this step, within "
                "num_speculative_tokens, max_new_tokens and the context limit)")
    bad = next((j for j, t in enumerate(ids) if not (isinstance(t, int) and not isinstance(t, bool)
                                                      and 0 <= t < vocab_size)), None)
    if bad is not None:
        return f"proposed draft {bad} = {ids[bad]!r}, not a token id of the vocabulary [0, {vocab_size})"
    probs = proposal.probs
    if probs is None or not ids:
        return ""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        return f"returned probs of type {type(probs).__name__}, expected a floating-point tensor"
    if tuple(probs.shape) != (len(ids), vocab_size):
        return f"returned probs of shape {tuple(probs.shape)}, expected ({len(ids)}, {vocab_size})"
    p = probs.detach().double()
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or not torch.allclose(
            p.sum(-1), torch.ones(len(ids), dtype=p.dtype, device=p.device), atol=_PROBS_SUM_TOL):
        return "returned probs that are not distributions (each row finite, >= 0, summing to 1)"
    return ""
