"""The generation driver: continuous batching over any backend, KV cache and sampler.

One :meth:`Engine.step` is::

    schedule   →  execute                    →  sample   →  update_from_output
    Scheduler     Forward (or Verifier):         Sampler     Scheduler
    (KV room)     metadata, backend plan, model              (tokens, stop checks, forks, finishes, frees)

The scheduler fills one forward with rows and reserves their KV room (:mod:`kvcore.scheduling.scheduler`):
decode rows and, with chunked prefill, prompt chunks; a partly prefilled request produces no token until its
last chunk. A step with a prefill row runs on the prefill backend, else on the decode backend
(:mod:`kvcore.engine.forward`); with a proposer, a decode step scores drafts (:mod:`kvcore.engine.verify`).

``n > 1``: :meth:`Engine.add_request` returns the group id ``rid``; its samples are requests ``f"{rid}:{i}"``
(:meth:`Engine.sample_ids`). Sample 0 prefills the prompt once; its last position's logits give every sample's
first token, then the others fork its KV blocks (copy-on-write). Sample ``i`` uses seed ``seed + i``.

Failures: an error of a forward or sampler fails the requests of that forward only. An exception or
KeyboardInterrupt anywhere inside :meth:`Engine.step` leaves every request untouched, re-queued for recomputation
(same stream), or failed, and no KV block leaked; events made before it come with the next step.

Threading: an ``Engine`` is not thread-safe. Call every method from one thread (a serving front owns
the engine in one loop and talks to it through queues).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from kvcore.engine.assembly import assemble
from kvcore.engine.build import load_model, serving_config
from kvcore.engine.config import EngineConfig, parse_dtype
from kvcore.engine.defaults import DefaultChoice, choose_defaults, file_facts, model_facts
from kvcore.engine.file_config import errors_located
from kvcore.engine.forward import Forward
from kvcore.engine.requests import (
    new_requests,
    prompt_batch,
    prompt_token_ids,
    request_result,
    run_batch,
    run_chat,
    stream_events,
)
from kvcore.engine.settings import Settings, prepare_run
from kvcore.engine.verify import Verifier
from kvcore.errors import InvalidRequestError, KVCoreError, ModelFileChangedError, RequestAbortedError
from kvcore.execution.runner import Executor
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.sampler import Sampler, SamplingParams
from kvcore.loaders.watched import model_file_problem
from kvcore.model.decoder import LlamaModel
from kvcore.plugins.registry import PluginRegistry, get_registry
from kvcore.sampling.structured import GrammarCompiler
from kvcore.scheduling.batch import ScheduledBatch
from kvcore.scheduling.request import EngineGauges, EngineStats, FinishReason, GenerationResult, Request, TokenEvent
from kvcore.scheduling.scheduler import Scheduler
from kvcore.speculative.speculator import speculator_for
from kvcore.text.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "parse_dtype"]


class Engine:
    """Runs requests through a model with the configured backends, KV cache and sampler. Use :meth:`add_request`
    + :meth:`step` (a serving loop), or the conveniences :meth:`generate` and :meth:`stream`."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        registry: PluginRegistry | None = None,
        sampler: Sampler | None = None,
        choice: DefaultChoice | None = None,
    ) -> None:
        registry = registry or get_registry()
        #: what kvcore decided for the settings left automatic, and why (kvcore.engine.defaults)
        self.choice = choice or choose_defaults(config or EngineConfig(), model_facts(model), registry)
        self.config = config = self.choice.apply(config or EngineConfig())
        self.model, self.tokenizer = model, tokenizer
        self.dtype, self.device = parse_dtype(config.dtype), torch.device(config.device)
        parts = assemble(registry, config, model, sampler, self.dtype, self.device)
        #: each layer's attention as this engine runs it: the model's, with config.attention_variants bound
        self.attention_layers = parts.attention_layers
        self.prefill_backend, self.decode_backend = parts.prefill_backend, parts.decode_backend
        self.compiled_decode, self.lm_head = parts.compiled_decode, parts.lm_head
        #: runs each step's forward: here, or on every rank of the tensor-parallel group
        self.runner: Executor = parts.runner
        self.sampler, self.max_model_len = parts.sampler, parts.max_model_len
        self.kv, self.kv_cache_name = parts.kv, parts.kv_cache_name
        mc = parts.model_config
        #: counters since construction (prefill / cached / decode / generated tokens, preemptions, ...)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.stats, self.max_model_len)
        eos = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[str]] = {}  # n > 1: group id -> its sample ids
        self._events: list[TokenEvent] = []  # made by the current step (or an interrupted one), not yet returned
        self._ids = itertools.count()
        #: compiles structured-output constraints (cached per grammar); None without a tokenizer
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size, sorted(eos)) if tokenizer is not None else None
        #: speculative decoding (config.proposer): the proposer and its counters; None = off
        self.speculator = speculator_for(self, registry)
        self.forward = Forward(self)  # runs a batch: metadata, the executor's forward, the sampler
        self.verifier = Verifier(self, self.speculator, self.forward, self.max_model_len) if self.speculator else None

    def serving_config(self) -> dict[str, Any]:
        """What serves requests: backends, KV cache, sampler, dtype, weights, device and limits (the start-up
        banner and ``/v1/models`` show it)."""
        return serving_config(self)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or at exit)."""
        self.runner.close()

    @property
    def cache(self) -> KVCache:
        """The KV cache (storage); its blocks are addressed through ``self.kv``."""
        return self.kv.cache

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2",
        config: EngineConfig | None = None,
        *,
        model_cache: bool | None = None,
        request_tokens: Callable[[Any], int] | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load ``model`` ("smollm2", a .gguf file or a Hugging Face directory) and build an engine.

        :param model_cache: keep the prepared model on disk so the next start skips conversion
            (:mod:`kvcore.loaders.model_cache`); None = on unless ``KVCORE_MODEL_CACHE=0``.
        :param request_tokens: for an engine that runs one known request (``kvcore generate``): given the
            tokenizer, the tokens it needs (prompt + new tokens). Without ``max_model_len`` the KV cache is then
            sized to it instead of to the model's window.
        """
        from kvcore.loaders.heap import load_scope

        config = config or EngineConfig()
        choice = choose_defaults(config, file_facts(model), kwargs.get("registry"))
        with load_scope():  # what loading frees goes back to the system (the LM head is packed in the engine)
            decoder, tokenizer, config = load_model(model, choice.apply(config), model_cache, request_tokens)
            return cls(decoder, tokenizer, config, choice=choice, **kwargs)

    @classmethod
    def from_settings(cls, settings: Settings, *, registry: PluginRegistry | None = None, **kwargs: Any) -> Engine:
        """The engine a :class:`~kvcore.engine.settings.Settings` describes (e.g. from ``load_settings``):
        :func:`~kvcore.engine.settings.prepare_run` (threads, plugin option tables), then :meth:`from_pretrained`
        with its model and engine config. Requests take ``settings.sampling``."""
        with errors_located(settings.config_file):  # e.g. an option a plugin rejects: the file's line
            registry = prepare_run(settings, registry)
            return cls.from_pretrained(settings.model, settings.engine, registry=registry, **kwargs)

    # -- request API ---------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id (with ``params.n > 1`` the group id, see :meth:`sample_ids`).
        Invalid requests raise and leave the engine untouched."""
        params = params or SamplingParams()
        prompt_ids = prompt_token_ids(prompt, params, self.tokenizer, self.model, self.config.max_num_seqs,
                                      self.max_model_len)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        ids = [request_id] if params.n == 1 else [f"{request_id}:{i}" for i in range(params.n)]
        taken = [r for r in (request_id, *ids) if r in self._requests or r in self._groups]
        if taken:
            raise InvalidRequestError(f"request id '{taken[0]}' is already in use")
        reqs = new_requests(ids, prompt_ids, params, self.eos_token_ids, self.tokenizer, self.grammars)
        self._requests.update((req.request_id, req) for req in reqs)
        if params.n > 1:
            self._groups[request_id] = ids
        reqs[0].pending_samples = reqs[1:]  # they fork sample 0's prompt blocks once it is computed
        self.scheduler.add(reqs[0])
        return request_id

    def sample_ids(self, request_id: str) -> list[str]:
        """The request ids of the samples of ``request_id``: ``[f"{rid}:{i}" for i in range(n)]`` for a
        request added with ``n > 1``, else ``[request_id]``. Each is streamed, aborted and released on its
        own (:class:`TokenEvent`.request_id is the sample id); :meth:`abort` of the group id aborts all."""
        return list(self._groups.get(request_id, [request_id]))

    def abort(self, request_id: str) -> None:
        """Stop a request (or every sample of a group) now; its KV blocks are freed, others are unaffected."""
        for rid in self.sample_ids(request_id):
            req = self._requests.get(rid)
            if req is None or req.is_finished:
                continue
            # The caller asked for it, so no event: the previous step's event list stays as it was returned.
            self._fail([(req, RequestAbortedError(f"request '{rid}' was aborted"))], FinishReason.ABORT, emit=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_finished(self, request_id: str) -> bool:
        """Whether request ``request_id`` (a sample id for ``n > 1``) has finished."""
        return self._requests[request_id].is_finished

    def result(self, request_id: str) -> GenerationResult:
        """The state of one request (a sample id for ``n > 1``); final once it finished."""
        return request_result(self._requests[request_id], self.tokenizer)

    def release(self, request_id: str) -> GenerationResult:
        """Result of a finished request, then forget it."""
        result = self.result(request_id)
        if self._requests[request_id].is_finished:
            del self._requests[request_id]
            group = request_id.rpartition(":")[0]
            if group in self._groups and not any(r in self._requests for r in self._groups[group]):
                del self._groups[group]
        return result

    # -- conveniences --------------------------------------------------------------------------------
    def generate(self, prompts: str | Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run a batch of prompts (any lengths) to completion; results in prompt order (with ``n > 1``,
        a prompt's n samples in sample order). A single string is one prompt (as in vLLM); so is a flat
        list of token ids. Interrupted, it aborts and forgets its requests."""
        return run_batch(self, prompt_batch(prompts, params))

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None, tools: list[dict] | None = None
    ) -> GenerationResult:
        """Answer one conversation (``[{"role": ..., "content": ...}, ...]``): the messages rendered with the
        model's chat template (:meth:`Tokenizer.apply_chat_template`, with ``tools`` when given), then
        generated to completion; with ``params.n > 1`` the first sample (use :meth:`generate` for all)."""
        return run_chat(self, messages, params, tools)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[TokenEvent]:
        """Yield the :class:`TokenEvent` of each generated token of one request (of each sample, n > 1).
        The request is released when the stream ends or is closed; keep the events for its text."""
        return stream_events(self, prompt, params)

    def gauges(self) -> EngineGauges:
        """What the engine holds now: requests running, waiting and kept, KV blocks (:attr:`stats` counts what
        it did since it was made)."""
        return EngineGauges(len(self.scheduler.running), len(self.scheduler.waiting), len(self._requests),
                            self.kv.num_blocks, self.kv.num_free_blocks)

    # -- one step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Run one forward of the scheduled rows; returns the events it made (one per sampled token, and one
        per request that failed)."""
        try:
            scheduled = self.scheduler.schedule()
            self._fail(scheduled.failed)
            if scheduled.batch is not None:
                self.stats.num_steps += 1
                self._run(scheduled.batch)
        except BaseException:
            self.scheduler.recover(self._requests.values())
            raise
        events, self._events = self._events, []
        return events

    def model_problem(self) -> str | None:
        """Why the model can no longer run, or None: a file its weights, or a draft model's, are read from as it
        runs was truncated or written to in place (:mod:`kvcore.loaders.watched`). One ``fstat`` per such file;
        any thread."""
        return model_file_problem(self.model, *(self.speculator.models if self.speculator is not None else ()))

    def _run(self, batch: ScheduledBatch) -> None:
        """Execute and sample one reserved batch, then have the scheduler settle it."""
        problem = self.model_problem()
        if problem is not None:  # the weights are no longer those loaded, or no longer there: run nothing on them
            return self._fail([(req, ModelFileChangedError(problem)) for req in batch.requests])
        ran = self.verifier.run(batch) if self.verifier is not None else None
        ran = ran or self.forward.run(batch)
        self._fail(ran.failed)
        if ran.output is not None:
            num_emitted, first = [len(r.output_ids) for r in ran.output.batch.requests], len(self._events)
            self.scheduler.update_from_output(ran.output, self._events)
            if self.verifier is not None:
                ended = [self._requests[e.request_id] for e in self._events[first:] if e.finish_reason is not None]
                self._fail(self.verifier.settled(ran.output, num_emitted, ended))
        for part in ran.retry:  # a failed mixed batch, one phase at a time
            failed = self.scheduler.reserve(part)
            self._fail(failed) if failed else self._run(part)

    def _fail(self, failed: list[tuple[Request, KVCoreError]], reason: FinishReason = FinishReason.ERROR,
              emit: bool = True) -> None:
        """End each request of ``failed`` with its error (an event says so, unless not ``emit``)."""
        for req, error in failed:
            self.scheduler.finish(req, reason, error)
            if self.speculator is not None:
                self.speculator.finish(req)
            if emit:
                self._events.append(TokenEvent(req.request_id, None, "", reason, error))

