"""One speculative step: every decoding row scores its last token and its drafts in one forward, keeps the
drafts the acceptance rules allow plus one token of the target's own, and the KV cache goes back past the
rest.

Row ``i`` of the forward is ``[last token, d_1 .. d_k]`` at positions ``c .. c + k`` after ``c`` cached tokens:
a multi-token decode row, causal among its own tokens (as a chunked-prefill chunk is). Position ``j``'s
logits give the target's token after ``d_j``; the sampler picks it with the request's history extended by
``d_1 .. d_j`` (:class:`DraftView`). With ``a`` drafts kept, the step emits
``a + 1`` tokens one by one (each with its stop checks, so stop strings, EOS and ``max_new_tokens`` end the
stream exactly where they would without speculation), and ``c + 1 + a`` tokens stay in the cache: the
scheduler's :meth:`~kvcore.scheduling.scheduler.Scheduler.roll_back` gives back the blocks past them, and only
then are the kept full blocks committed to the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcore.errors import BackendError, KVCoreError, NonFiniteRowsError
from kvcore.interfaces.proposer import Proposal
from kvcore.interfaces.sampler import SamplingParams
from kvcore.sampling.processors import token_logprobs
from kvcore.sampling.rejection import num_matching, rejection_sample
from kvcore.sampling.sampler import logprobs_checked, sample_checked
from kvcore.scheduling.batch import ScheduledBatch
from kvcore.scheduling.request import Request
from kvcore.speculative.speculator import Speculator

__all__ = ["DraftView", "SpeculativeStep"]


@dataclass(frozen=True)
class DraftView:
    """A request as the sampler sees it at one draft position: its output extended by the drafts before it
    (a :class:`~kvcore.interfaces.sampler.SamplingRow`, so penalties and seeded draws see that history)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int


class SpeculativeStep:
    """The speculative half of :class:`~kvcore.engine.step.EngineStep` (it inherits this)."""

    speculator: Speculator | None
    attention_layers: tuple  # EngineStep's: each layer's attention as the engine runs it

    def _speculate(self, batch: ScheduledBatch) -> bool:
        """Run ``batch`` (decode rows only) with drafts; False when no row got any (the step then runs as
        usual), or when a row has structured output (its grammar masks each token as its state advances)."""
        reqs = batch.requests
        if any(r.matcher is not None for r in reqs):
            return False
        max_seq_len = self.kv.max_seq_len
        budgets = [self.speculator.budget(r, self.max_model_len, max_seq_len) for r in reqs]
        room = self.scheduler.max_num_batched_tokens - len(reqs)
        for i, b in enumerate(budgets):  # drafts fill what the step's token budget leaves
            budgets[i], room = min(b, room), room - min(b, room)
        try:
            proposals, refused = self.speculator.propose(reqs, budgets, self.model.config.vocab_size)
        except KVCoreError as exc:
            self._fail(reqs, exc)
            return True
        if refused:  # only the rows whose proposal was refused fail; the others run again next step
            for i, exc in refused.items():
                self._fail([reqs[i]], exc)
            return True
        query_lens = [1 + len(p.token_ids) for p in proposals]
        seq_ids = [r.seq_id for r in reqs]
        if max(query_lens) == 1 or not self.kv.can_reserve(seq_ids, query_lens):
            return False
        try:
            meta = self.kv.prepare(seq_ids, query_lens, self.model.attention_scale, self.attention_layers)
        except KVCoreError as exc:  # reserve() is all or nothing: nothing to roll back
            self._fail(reqs, exc)
            return True
        input_ids = [t for r, p in zip(reqs, proposals) for t in (r.output_ids[-1], *p.token_ids)]
        backend = self.decode_backend
        try:
            logits = self.runner.forward_positions(backend, self.kv.cache, meta, input_ids, range(len(reqs)),
                                                   query_lens)
        except Exception as exc:  # nothing is committed: every row goes back to its computed tokens
            self.scheduler.roll_back(reqs)
            if isinstance(exc, NonFiniteRowsError):
                bad = set(exc.seq_indices)
                self._fail([r for i, r in enumerate(reqs) if i in bad], exc)
                return True  # the others run again next step
            error = exc if isinstance(exc, KVCoreError) else BackendError(
                f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            self._fail(reqs, error)
            return True
        views = [DraftView(r.request_id, r.prompt_ids, r.output_ids + p.token_ids[:j], r.params, r.seed)
                 for r, p in zip(reqs, proposals) for j in range(len(p.token_ids) + 1)]
        try:
            emitted = self._verified(logits, views, reqs, proposals)
        except KVCoreError as exc:
            self.scheduler.roll_back(reqs)
            self._fail(reqs, exc)
            return True
        self.stats.num_decode_tokens += len(reqs)
        for req, proposal, tokens in zip(reqs, proposals, emitted):
            sent = 0
            for token in tokens:
                if not req.is_finished:
                    self._advance(req, 1, token)
                    sent += 1
            if proposal.token_ids:  # the drafts counted as accepted are the ones the stream emitted
                try:
                    self.speculator.advance(req, len(proposal.token_ids), min(sent, len(tokens) - 1))
                except KVCoreError as exc:  # its tokens stand; the proposer cannot go on with it
                    self._fail([req], exc)
            if not req.is_finished:
                self.scheduler.roll_back([req])  # the cache keeps the last token and the kept drafts only
                self.scheduler.commit([req], [0])
        return True

    def _verified(
        self, logits: torch.Tensor, views: list[DraftView], reqs: list[Request], proposals: list[Proposal]
    ) -> list[list[tuple[int, Any]]]:
        """Per row, the tokens the step emits with their logprobs: the kept drafts, then the target's own."""
        self._suppress_eos(views, logits)
        rejecting = [p.probs is not None and not r.params.is_greedy for r, p in zip(reqs, proposals)]
        target_logprobs = logprobs_checked(self.sampler, logits, views) if any(rejecting) else None
        picks, logprobs = sample_checked(self.sampler, logits, views)
        out, start = [], 0
        for req, proposal, rejects in zip(reqs, proposals, rejecting):
            drafts, n = proposal.token_ids, len(proposal.token_ids) + 1
            row_picks, row_lps = picks[start : start + n], logprobs[start : start + n]
            if not rejects:
                kept = num_matching(drafts, row_picks)
                out.append(list(zip(row_picks[: kept + 1], row_lps[: kept + 1])))
            else:
                p = target_logprobs[start : start + n - 1].exp()
                kept, token = rejection_sample(drafts, p, proposal.probs, req.seed, len(req.output_ids))
                tokens = [*drafts[:kept], token if token is not None else row_picks[-1]]
                if req.params.logprobs is not None:  # the target's logprobs of the tokens it emits
                    ids = torch.tensor(tokens, device=logits.device)
                    row_lps = token_logprobs(target_logprobs[start : start + kept + 1], ids,
                                             [req.params.logprobs] * len(tokens))
                out.append(list(zip(tokens, row_lps[: kept + 1])))
            start += n
        return out
