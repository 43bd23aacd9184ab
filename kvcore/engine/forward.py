"""Run one reserved batch: its attention metadata, the executor's forward, the sampler; and what fails, how.

:meth:`Forward.run` turns a :class:`~kvcore.scheduling.batch.ScheduledBatch` whose KV room the scheduler reserved
into a :class:`Ran`: the :class:`~kvcore.scheduling.batch.ModelOutput` the scheduler settles, the requests that
failed (their reservation rolled back) and the batches to run again. A forward's or the sampler's
:class:`~kvcore.errors.KVCoreError` fails the requests of that forward only: a batch mixing decode and prefill
rows is retried split by phase first, so a failing prefill cannot take the running streams down; an error that
names some sequences (:class:`~kvcore.errors.NonFiniteRowsError`) fails those, and the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvcore.errors import BackendError, KVCoreError, NonFiniteRowsError
from kvcore.execution.runner import Executor
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.interfaces.sampler import Sampler, SamplingRow
from kvcore.model.decoder import LlamaModel
from kvcore.sampling.sampler import sample_checked
from kvcore.sampling.structured import GrammarCompiler, apply_grammar_masks
from kvcore.scheduling.batch import ModelOutput, ScheduledBatch
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.request import Request
from kvcore.scheduling.scheduler import Scheduler

__all__ = ["EngineParts", "Forward", "Ran"]


class EngineParts(Protocol):
    """The parts of an :class:`~kvcore.engine.core.Engine` a step runs on, read when it runs (a test or a tool
    may swap a backend on the engine)."""

    kv: KVCacheManager
    scheduler: Scheduler
    runner: Executor
    model: LlamaModel
    attention_layers: tuple[LayerAttention, ...]  # the model's, with the engine's attention variants bound
    sampler: Sampler
    prefill_backend: AttentionBackend
    decode_backend: AttentionBackend
    eos_token_ids: frozenset[int]
    grammars: GrammarCompiler | None  # None without a tokenizer


@dataclass
class Ran:
    """What running a batch gave: the output to settle (None: nothing ran to completion), the requests that
    failed with why, and the batches to reserve and run again (a failed mixed batch, one per phase)."""

    output: ModelOutput | None = None
    failed: list[tuple[Request, KVCoreError]] = field(default_factory=list)
    retry: list[ScheduledBatch] = field(default_factory=list)


class Forward:
    """Runs reserved batches on ``engine``'s executor and sampler."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self._eos_columns: tuple[tuple[frozenset[int], torch.device], torch.Tensor] | None = None

    def metadata(self, batch: ScheduledBatch) -> AttentionMetadata:
        e = self.engine
        return e.kv.metadata([r.seq_id for r in batch.requests], batch.query_lens, e.model.attention_scale,
                             e.attention_layers)

    def run(self, batch: ScheduledBatch) -> Ran:
        """Forward and sample ``batch``: one token for each row that completes its sequence (and, for an ``n > 1``
        leader completing its prompt, one for each of its samples, from the same logits row)."""
        e = self.engine
        backend = e.prefill_backend if batch.is_prefill else e.decode_backend
        sampling = [i for i, s in enumerate(batch.samples) if s]
        ran = Ran()
        try:
            logits = e.runner.forward(batch.is_prefill, backend, e.kv.cache, self.metadata(batch), batch.input_ids,
                                      batch.copies, sampling)
        except NonFiniteRowsError as exc:  # only some sequences are not finite: they fail, the others go on
            batch, sampling, logits = self._drop_rows(batch, sampling, exc, ran)
        except Exception as exc:
            error = exc if isinstance(exc, KVCoreError) else BackendError(
                f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            return self._failed(batch, error)
        reqs = batch.requests
        rows: list[Request] = []
        index: list[int] = []
        for j, i in enumerate(sampling):
            group = [reqs[i]] + [c for c in reqs[i].pending_samples if not c.is_finished]
            rows += group
            index += [j] * len(group)
        next_ids, logprobs = [], []
        try:
            if rows:  # a step of partial prefill chunks only samples nothing
                logits = logits[torch.tensor(index, device=logits.device)] if len(index) != len(sampling) else logits
                self.suppress_eos(rows, logits)
                apply_grammar_masks(logits, rows, e.grammars)
                next_ids, logprobs = sample_checked(e.sampler, logits, rows)
        except KVCoreError as exc:
            failed = self._failed(batch, exc)
            failed.failed[:0] = ran.failed  # the rows _drop_rows failed first
            return failed
        sampled = {id(r): (t, lp) for r, t, lp in zip(rows, next_ids, logprobs)}
        tokens = [[sampled[id(r)]] if id(r) in sampled else [] for r in reqs]
        in_batch = {id(r) for r in reqs}
        forks = {r.request_id: sampled[id(r)] for r in rows if id(r) not in in_batch}
        ran.output = ModelOutput(batch, tokens, forks)
        return ran

    def suppress_eos(self, rows: list[SamplingRow], logits: torch.Tensor) -> None:
        """Set to -inf the EOS logits of the ``ignore_eos`` rows of ``logits`` ``[len(rows), V]``, in place."""
        # ignore_eos suppresses EOS (llama.cpp --ignore-eos, transformers min_new_tokens): the stream then
        # holds exactly max_new_tokens real tokens instead of EOS followed by noise.
        eos = self.engine.eos_token_ids
        banned_rows = [i for i, r in enumerate(rows) if r.params.ignore_eos]
        if not (banned_rows and eos):
            return
        key = (eos, logits.device)
        if self._eos_columns is None or self._eos_columns[0] != key:  # made once, not per step
            self._eos_columns = (key, torch.tensor(sorted(eos), device=logits.device))
        cols = self._eos_columns[1]
        if len(banned_rows) == logits.shape[0]:
            logits.index_fill_(1, cols, float("-inf"))  # one op; indexing assignment dispatches several
        else:
            logits[torch.tensor(banned_rows, device=logits.device)[:, None], cols[None, :]] = float("-inf")

    def _drop_rows(
        self, batch: ScheduledBatch, sampling: list[int], error: NonFiniteRowsError, ran: Ran
    ) -> tuple[ScheduledBatch, list[int], torch.Tensor]:
        """Fail the sequences ``error`` names (their reservation rolled back) and return the rest of the
        batch, its sampling rows and their logits, as if only they had run."""
        bad = set(error.seq_indices)
        for i in sorted(bad):
            self.engine.scheduler.roll_back([batch.requests[i]])
            ran.failed.append((batch.requests[i], error))
        keep = [i for i in range(len(batch.requests)) if i not in bad]
        position = {old: new for new, old in enumerate(keep)}
        kept_rows = [j for j, i in enumerate(sampling) if i not in bad]
        logits = error.logits[torch.tensor(kept_rows, dtype=torch.long, device=error.logits.device)]
        rest = ScheduledBatch([batch.requests[i] for i in keep], [batch.query_lens[i] for i in keep],
                              [batch.is_decode[i] for i in keep], batch.copies)
        return rest, [position[sampling[j]] for j in kept_rows], logits

    def _failed(self, batch: ScheduledBatch, error: KVCoreError) -> Ran:
        """A forward or the sampler failed after the batch was reserved: roll the reservation back; a batch
        mixing decode and prefill rows is run again as two batches, one per phase, else its requests fail."""
        reqs = batch.requests
        self.engine.scheduler.roll_back(reqs)
        if not (batch.is_prefill and any(batch.is_decode)):
            return Ran(failed=[(r, error) for r in reqs])
        parts = []
        for phase in (True, False):
            rows = [i for i, d in enumerate(batch.is_decode) if d == phase]
            parts.append(ScheduledBatch([reqs[i] for i in rows], [batch.query_lens[i] for i in rows],
                                        [phase] * len(rows)))
        return Ran(retry=parts)
