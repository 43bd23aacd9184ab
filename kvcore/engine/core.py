"""The generation driver: continuous batching over any backend, KV cache and sampler.

One :meth:`Engine.step` is::

    schedule  →  metadata (once)  →  backend plan (once)  →  model  →  sampler  →  post-process
    Scheduler    KVCacheManager       AttentionBackend         LlamaModel  Sampler    Engine
                 .prepare              .plan                                          (stop checks, events)

The scheduler fills one forward with rows (see :mod:`kvcore.scheduling.scheduler`): decode rows of the running
requests and, with chunked prefill, prompt chunks in the same call. Rows that complete their sequence
are sampled; a partly prefilled request produces no token until its last chunk. A step with any prefill
row runs on the prefill backend, a pure decode step on the decode backend. Requests leave the batch the
step they finish, giving their KV blocks back.

``n > 1``: :meth:`Engine.add_request` returns the group id ``rid``; its samples are requests
``f"{rid}:{i}"`` (:meth:`Engine.sample_ids`). Sample 0 prefills the prompt once; its last position's
logits give every sample's first token, then the others fork its KV blocks (copy-on-write). Sample
``i`` uses seed ``seed + i``.

Failures and interruptions: an error of a forward or sampler fails the requests of that forward only
(a forward mixing decode and prefill rows is retried split by phase first, so a failing prefill cannot
take the running streams down). An exception or KeyboardInterrupt anywhere inside :meth:`Engine.step`
leaves every request either untouched, re-queued for recomputation (same stream), or failed, and no
KV block leaked; events made before the interruption come with the next step.

Threading: an ``Engine`` is not thread-safe. Call every method from one thread (a serving front owns
the engine in one loop and talks to it through queues).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from kvcore.engine.build import (
    build_kv_cache,
    check_model,
    kv_groups,
    local_execution,
    prefix_namespace,
    serving_config,
    tensor_parallel_runner,
    variant_layers,
)
from kvcore.engine.config import EngineConfig, parse_dtype, select_components
from kvcore.engine.defaults import DefaultChoice, choose_defaults, file_facts, model_facts
from kvcore.engine.file_config import errors_located
from kvcore.engine.requests import prompt_batch, prompt_token_ids, request_result, run_batch, run_chat, stream_events
from kvcore.engine.settings import Settings, prepare_run
from kvcore.engine.step import EngineStep
from kvcore.errors import InvalidRequestError, RequestAbortedError
from kvcore.execution.runner import Executor, ModelRunner
from kvcore.interfaces.layer_attention import variants_of
from kvcore.interfaces.sampler import Sampler, SamplingParams
from kvcore.model.config import check_max_model_len
from kvcore.model.decoder import LlamaModel
from kvcore.plugins.registry import PluginRegistry, get_registry
from kvcore.sampling.structured import GrammarCompiler
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.request import EngineGauges, EngineStats, FinishReason, GenerationResult, Request, TokenEvent
from kvcore.scheduling.scheduler import Scheduler
from kvcore.speculative.speculator import speculator_for
from kvcore.text.outputs import StopStrings, TextOutput

__all__ = ["Engine", "EngineConfig", "parse_dtype"]


class Engine(EngineStep):
    """Runs requests through a model with the configured backends, KV cache and sampler.

    Use :meth:`add_request` + :meth:`step` (a serving loop), or the conveniences :meth:`generate` and
    :meth:`stream`.
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Any | None = None,
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
        mc = model.config
        self.dtype, self.device = parse_dtype(config.dtype), torch.device(config.device)
        weight_format = check_model(model, config)
        #: each layer's attention as this engine runs it: the model's, with config.attention_variants bound
        self.attention_layers = variant_layers(registry, config, model)
        tp_runner = tensor_parallel_runner(model, config)
        if tp_runner is not None:
            mc = tp_runner.model.config  # local heads: backends and the KV cache see only this rank's
        heads = dict(num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads)
        chosen = select_components(registry, config, head_dim=mc.head_dim, variants=variants_of(self.attention_layers),
                                   **heads)
        self.prefill_backend, self.decode_backend = chosen.prefill_backend, chosen.decode_backend
        backends = (self.prefill_backend, self.decode_backend)
        guards, self.compiled_decode, self.lm_head = local_execution(
            model, config, backends, self.device, tensor_parallel=tp_runner is not None
        )
        #: runs each step's forward: here, or on every rank of the tensor-parallel group
        self.runner: Executor = tp_runner or ModelRunner(model, guards, self.compiled_decode, self.lm_head)
        self.sampler = sampler or registry.create_sampler(config.sampler, config.sampler_options.get(config.sampler))
        window = mc.max_position_embeddings
        check_max_model_len(config.max_model_len, window)
        self.max_model_len = config.max_model_len or min(window, EngineConfig.DEFAULT_MAX_MODEL_LEN)
        groups, window_pool = kv_groups(self.attention_layers, mc.num_hidden_layers, config, chosen.kv_cache,
                                        self.max_model_len)
        cache, self.kv_cache_name = build_kv_cache(registry, chosen.kv_cache, config, mc, self.max_model_len, groups)
        cache_name = self.kv_cache_name
        self.runner.start(self.prefill_backend, self.decode_backend, cache, config)
        namespace = prefix_namespace(model, self.dtype, weight_format, cache_name, config)
        self.kv = KVCacheManager(cache, enable_prefix_caching=config.enable_prefix_caching, namespace=namespace,
                                 groups=groups, window_pool=window_pool)
        #: counters since construction (prefill / cached / decode / generated tokens, preemptions, ...)
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill, self.stats
        )
        eos = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[str]] = {}  # n > 1: group id -> its sample ids
        self._outputs: dict[str, TextOutput] = {}
        self._events: list[TokenEvent] = []
        self._ids = itertools.count()
        #: compiles structured-output constraints (cached per grammar); None without a tokenizer
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size, sorted(eos)) if tokenizer is not None else None
        #: speculative decoding (config.proposer): the proposer and its counters; None = off
        self.speculator = speculator_for(self, registry)

    def serving_config(self) -> dict[str, Any]:
        """What serves requests: backends, KV cache, sampler, dtype, weights, device and limits (the start-up
        banner and ``/v1/models`` show it)."""
        return serving_config(self)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or at exit)."""
        self.runner.close()

    @property
    def cache(self):
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
        from kvcore.loaders.heap import load_scope, trim_heap
        from kvcore.loaders.model_cache import load_pretrained

        config = config or EngineConfig()
        choice = choose_defaults(config, file_facts(model), kwargs.get("registry"))
        config = choice.apply(config)
        with load_scope():  # what loading frees goes back to the system (the LM head is packed in the engine)
            decoder, tokenizer = load_pretrained(
                model, parse_dtype(config.dtype), config.device, config.max_model_len, model_cache, config.weights
            )
            trim_heap()
            if request_tokens is not None and config.max_model_len is None:
                window = decoder.config.max_position_embeddings
                config = dataclasses.replace(config, max_model_len=min(window, max(2, request_tokens(tokenizer))))
            return cls(decoder, tokenizer, config, choice=choice, **kwargs)

    @classmethod
    def from_settings(cls, settings: Settings, *, registry: PluginRegistry | None = None, **kwargs: Any) -> Engine:
        """The engine a :class:`~kvcore.engine.settings.Settings` describes (e.g. from
        :func:`~kvcore.engine.settings.load_settings`): :func:`~kvcore.engine.settings.prepare_run` (threads, plugin
        option tables), then :meth:`from_pretrained` with its model and engine config. Requests take
        ``settings.sampling``."""
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
        prompt_ids = prompt_token_ids(
            prompt, params, self.tokenizer, self.model, self.config.max_num_seqs, self.max_model_len
        )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        ids = [request_id] if params.n == 1 else [f"{request_id}:{i}" for i in range(params.n)]
        taken = [r for r in (request_id, *ids) if r in self._requests or r in self._groups]
        if taken:
            raise InvalidRequestError(f"request id '{taken[0]}' is already in use")
        seed = params.seed if params.seed is not None else time.time_ns() % 2**63
        reqs = [Request(rid, list(prompt_ids), params, self.eos_token_ids, seed=seed + i) for i, rid in enumerate(ids)]
        if params.structured_output is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured output needs a tokenizer; this engine has none")
            for req in reqs:
                req.matcher = self.grammars.matcher(params.structured_output)
        for req in reqs:
            req.metrics.num_prompt_tokens = len(prompt_ids)
            decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
            self._outputs[req.request_id] = TextOutput(decoder, StopStrings(params.stop) if params.stop else None)
            self._requests[req.request_id] = req
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
            self._finish(req, FinishReason.ABORT, RequestAbortedError(f"request '{rid}' was aborted"), emit=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_finished(self, request_id: str) -> bool:
        """Whether request ``request_id`` (a sample id for ``n > 1``) has finished."""
        return self._requests[request_id].is_finished

    def result(self, request_id: str) -> GenerationResult:
        """The state of one request (a sample id for ``n > 1``); final once it finished."""
        return request_result(self._requests[request_id], self._outputs[request_id], self.tokenizer)

    def release(self, request_id: str) -> GenerationResult:
        """Result of a finished request, then forget it."""
        result = self.result(request_id)
        if self._requests[request_id].is_finished:
            del self._requests[request_id]
            self._outputs.pop(request_id, None)
            group = request_id.rpartition(":")[0]
            if group in self._groups and not any(r in self._requests for r in self._groups[group]):
                del self._groups[group]
        return result

    # -- conveniences --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
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

