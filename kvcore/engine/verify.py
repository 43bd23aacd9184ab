"""One speculative step: every decoding row scores its last token and its drafts in one forward, keeps the
drafts the acceptance rules allow plus one token of the target's own, and the KV cache goes back past the
rest.

Row ``i`` of the forward is ``[last token, d_1 .. d_k]`` at positions ``c .. c + k`` after ``c`` cached tokens:
a multi-token decode row, causal among its own tokens (as a chunked-prefill chunk is). Position ``j``'s
logits give the target's token after ``d_j``; the sampler picks it with the request's history extended by
``d_1 .. d_j`` (:class:`DraftView`). With ``a`` drafts kept, the step emits ``a + 1`` tokens, which the
scheduler's :meth:`~kvcore.scheduling.scheduler.Scheduler.update_from_output` settles one by one (each with its
stop checks, so stop strings, EOS and ``max_new_tokens`` end the stream exactly where they would without
speculation); ``c + 1 + a`` tokens stay in the cache: the scheduler gives back the blocks past them, and only then
commits the kept full blocks to the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.engine.forward import EngineParts, Forward, Ran
from kvcore.errors import BackendError, KVCoreError, NonFiniteRowsError
from kvcore.interfaces.proposer import Proposal
from kvcore.interfaces.sampler import SamplingParams
from kvcore.sampling.processors import token_logprobs
from kvcore.sampling.rejection import num_matching, rejection_sample
from kvcore.sampling.sampler import logprobs_checked, sample_checked
from kvcore.scheduling.batch import ModelOutput, Sampled, ScheduledBatch
from kvcore.scheduling.request import Request
from kvcore.speculative.speculator import Speculator

__all__ = ["DraftView", "Verifier"]


@dataclass(frozen=True)
class DraftView:
    """A request as the sampler sees it at one draft position: its output extended by the drafts before it
    (a :class:`~kvcore.interfaces.sampler.SamplingRow`, so penalties and seeded draws see that history)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int


class Verifier:
    """Runs decode batches with drafts: the speculator proposes them, the scheduler budgets and reserves them,
    one forward scores them, the acceptance rules keep some."""

    def __init__(self, engine: EngineParts, speculator: Speculator, forward: Forward, max_model_len: int) -> None:
        self.engine, self.speculator, self.forward, self.max_model_len = engine, speculator, forward, max_model_len

    def run(self, batch: ScheduledBatch) -> Ran | None:
        """Run ``batch`` (reserved) with drafts; None when it runs as usual: it has prefill rows, no row got drafts,
        or a row has structured output (its grammar masks each token as its state advances)."""
        self.speculator.release(self.engine.scheduler.waiting)  # preempted requests start again when they decode
        e, reqs = self.engine, batch.requests
        if batch.is_prefill or any(r.matcher is not None for r in reqs):
            return None
        max_seq_len = e.kv.max_seq_len
        budgets = e.scheduler.draft_budgets([self.speculator.budget(r, self.max_model_len, max_seq_len)
                                             for r in reqs])
        try:
            proposals, refused = self.speculator.propose(reqs, budgets, e.model.config.vocab_size)
        except KVCoreError as exc:
            return Ran(failed=[(r, exc) for r in reqs])
        if refused:  # only the rows whose proposal was refused fail; the others run again next step
            e.scheduler.roll_back(reqs)
            return Ran(failed=[(reqs[i], exc) for i, exc in refused.items()])
        num_drafts = [len(p.token_ids) for p in proposals]
        verify = e.scheduler.add_drafts(batch, num_drafts)
        if verify is None:
            return None
        input_ids = [t for r, p in zip(reqs, proposals) for t in (r.output_ids[-1], *p.token_ids)]
        backend = e.decode_backend
        try:
            logits = e.runner.forward_positions(backend, e.kv.cache, self.forward.metadata(verify), input_ids,
                                                range(len(reqs)), verify.query_lens, verify.copies)
        except Exception as exc:  # nothing is committed: every row goes back to its computed tokens
            e.scheduler.roll_back(reqs)
            if isinstance(exc, NonFiniteRowsError):  # the others run again next step
                bad = set(exc.seq_indices)
                return Ran(failed=[(r, exc) for i, r in enumerate(reqs) if i in bad])
            error = exc if isinstance(exc, KVCoreError) else BackendError(
                f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            return Ran(failed=[(r, error) for r in reqs])
        views = [DraftView(r.request_id, r.prompt_ids, r.output_ids + p.token_ids[:j], r.params, r.seed)
                 for r, p in zip(reqs, proposals) for j in range(len(p.token_ids) + 1)]
        try:
            emitted = self._verified(logits, views, reqs, proposals)
        except KVCoreError as exc:
            e.scheduler.roll_back(reqs)
            return Ran(failed=[(r, exc) for r in reqs])
        return Ran(ModelOutput(verify, emitted, num_drafts=num_drafts))

    def settled(self, output: ModelOutput, num_emitted: list[int], ended: list[Request]
                ) -> list[tuple[Request, KVCoreError]]:
        """Tell the speculator what the scheduler settled: the requests that ``ended``, and for a verification what
        each row's drafts got (``num_emitted``: its output's length before). Returns the requests whose proposer
        cannot go on (their tokens stand)."""
        for req in ended:
            self.speculator.finish(req)
        failed = []
        rows = zip(output.batch.requests, output.num_drafts or (), output.tokens, num_emitted)
        for req, num_drafts, tokens, before in rows:
            if num_drafts:  # the drafts counted as accepted are the ones the stream emitted
                try:
                    self.speculator.advance(req, num_drafts, min(len(req.output_ids) - before, len(tokens) - 1))
                except KVCoreError as exc:
                    failed.append((req, exc))
        return failed

    def _verified(
        self, logits: torch.Tensor, views: list[DraftView], reqs: list[Request], proposals: list[Proposal]
    ) -> list[list[Sampled]]:
        """Per row, the tokens the step emits with their logprobs: the kept drafts, then the target's own."""
        sampler = self.engine.sampler
        self.forward.suppress_eos(views, logits)
        rejecting = [p.probs is not None and not r.params.is_greedy for r, p in zip(reqs, proposals)]
        target_logprobs = logprobs_checked(sampler, logits, views) if any(rejecting) else None
        picks, logprobs = sample_checked(sampler, logits, views)
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
