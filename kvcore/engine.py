"""The generation driver: continuous batching over any backend, KV cache and sampler.

One :meth:`Engine.step` is::

    schedule  →  metadata (once)  →  backend plan (once)  →  model  →  sampler  →  post-process
    Scheduler    KVCacheManager       AttentionBackend         LlamaModel  Sampler    Engine
                 .prepare              .plan                                          (stop checks, events)

The scheduler either admits waiting requests for a prefill (their whole prompts in one packed forward;
the first token comes from each prompt's last position) or runs one decode step for every running
request. Requests join the running batch as soon as the cache has room and leave it the step they
finish, giving their KV blocks back.

Threading: an ``Engine`` is not thread-safe. Call every method from one thread (a serving front owns
the engine in one loop and talks to it through queues).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from kvcore.engine_config import EngineConfig, parse_dtype, select_components
from kvcore.errors import (
    BackendError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    KVCoreError,
    RequestAbortedError,
)
from kvcore.kv_cache import CacheSpec
from kvcore.kv_manager import KVCacheManager
from kvcore.model import LlamaModel
from kvcore.model_runner import last_token_logits
from kvcore.plugins import PluginRegistry, get_registry
from kvcore.request import FinishReason, GenerationResult, Request, TokenEvent
from kvcore.sampling import Sampler, SamplingParams, sample_checked
from kvcore.scheduler import ScheduledBatch, Scheduler

__all__ = ["Engine", "EngineConfig", "parse_dtype"]


class Engine:
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
    ) -> None:
        self.config = config = config or EngineConfig()
        registry = registry or get_registry()
        self.model, self.tokenizer = model, tokenizer
        mc = model.config
        self.dtype, self.device = parse_dtype(config.dtype), torch.device(config.device)
        if model.dtype != self.dtype:
            raise ConfigError(f"model weights are {model.dtype} but the engine was configured for {self.dtype}")
        self.runner = None  # tensor parallelism: rank 0's side of the group; this process computes rank 0's shard
        if config.tensor_parallel_size > 1:
            from kvcore.distributed import TensorParallelRunner

            self.runner = TensorParallelRunner(model, config)
            mc = self.runner.model.config  # local heads: backends and the KV cache see only this rank's
        heads = dict(num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads)
        chosen = select_components(registry, config, head_dim=mc.head_dim, **heads)
        self.prefill_backend, self.decode_backend = chosen.prefill_backend, chosen.decode_backend
        self.sampler = sampler or registry.create_sampler(config.sampler, config.sampler_options.get(config.sampler))
        window = mc.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(window, EngineConfig.DEFAULT_MAX_MODEL_LEN), window)
        spec = CacheSpec(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_num_seqs=config.max_num_seqs,
            max_seq_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
        )
        cache_name, cache_options = chosen.kv_cache.name, config.kv_cache_options.get(chosen.kv_cache.name)
        if config.kv_cache_bytes and not config.num_blocks:
            if not chosen.kv_cache.cls.paged:
                raise ConfigError(f"kv_cache_bytes sizes a paged cache; '{cache_name}' reserves one slot per sequence")
            block_size = (cache_options or {}).get("block_size", config.block_size)
            per_block = chosen.kv_cache.cls.token_bytes(spec) * block_size
            spec = dataclasses.replace(spec, num_blocks=max(1, config.kv_cache_bytes // per_block))
        cache = registry.create_cache(cache_name, spec, cache_options)
        if self.runner is not None:
            self.runner.start(self.prefill_backend, self.decode_backend, cache, config)
        self.kv = KVCacheManager(cache, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._decoders: dict[str, Any] = {}
        self._events: list[TokenEvent] = []  # what the current step() reports
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or at exit)."""
        if self.runner is not None:
            self.runner.close()

    @property
    def cache(self):
        """The KV cache (storage); its blocks are addressed through ``self.kv``."""
        return self.kv.cache

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "smollm2", config: EngineConfig | None = None, **kwargs: Any) -> Engine:
        """Load ``model`` ("smollm2", a .gguf file or a Hugging Face directory) and build an engine."""
        from kvcore.loaders import load_model

        config = config or EngineConfig()
        loaded = load_model(model)
        llama = LlamaModel.from_weights(loaded.config, loaded.weights, parse_dtype(config.dtype)).to(config.device)
        return cls(llama, loaded.tokenizer, config, **kwargs)

    # -- request API ---------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Invalid requests raise and leave the engine untouched."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass prompt token ids")
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds "
                f"the context limit of {self.max_model_len} tokens; shorten the prompt or lower max_new_tokens"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        seed = params.seed if params.seed is not None else time.time_ns() % 2**63
        req = Request(request_id, prompt_ids, params, self.eos_token_ids, seed=seed)
        req.metrics.num_prompt_tokens = len(prompt_ids)
        self._requests[request_id] = req
        self.scheduler.add(req)
        if self.tokenizer is not None:
            self._decoders[request_id] = self.tokenizer.stream_decoder()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed and other requests are unaffected."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        # The caller asked for it, so no event: the previous step's event list stays as it was returned.
        self._finish(req, FinishReason.ABORT, RequestAbortedError(f"request '{request_id}' was aborted"), emit=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def result(self, request_id: str) -> GenerationResult:
        req = self._requests[request_id]
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer is not None else ""
        return GenerationResult(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason,
            metrics=req.metrics,
            error=req.error,
        )

    def release(self, request_id: str) -> GenerationResult:
        """Result of a finished request, then forget it."""
        result = self.result(request_id)
        if self._requests[request_id].is_finished:
            del self._requests[request_id]
            self._decoders.pop(request_id, None)
        return result

    # -- the loop ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Advance every unfinished request by one token (prefilling newcomers first)."""
        self._events = []
        scheduled = self.scheduler.schedule()
        for req, error in scheduled.failed:
            self._finish(req, FinishReason.ERROR, error)
        if scheduled.batch is not None:
            self._execute(scheduled.batch)
        return self._events

    def _execute(self, batch: ScheduledBatch) -> None:
        """Run one forward and sample; if it raises, the batch's requests fail (and free their blocks)
        while every other request, waiting or running, is untouched."""
        reqs = batch.requests
        backend = self.prefill_backend if batch.is_prefill else self.decode_backend
        try:
            try:
                meta = self.kv.prepare([r.seq_id for r in reqs], batch.query_lens, self.model.attention_scale)
                if self.runner is not None:
                    logits = self.runner.forward(batch.is_prefill, backend, self.kv.cache, meta, batch.input_ids,
                                                 self.kv.last_copies)
                else:
                    logits = last_token_logits(self.model, backend, self.kv.cache, meta, batch.input_ids)  # [B, V]
            except KVCoreError:
                raise
            except Exception as exc:
                raise BackendError(f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}") from exc
            if self.kv.blocks.enable_prefix_caching:
                for req in reqs:
                    self.kv.blocks.commit(req.seq_id, req.all_ids)
            self._suppress_eos(reqs, logits)
            next_ids = sample_checked(self.sampler, logits, reqs)
        except KVCoreError as exc:
            for req in reqs:
                self._finish(req, FinishReason.ERROR, exc)
            return
        self._append_tokens(reqs, next_ids)

    def _suppress_eos(self, reqs: list[Request], logits: torch.Tensor) -> None:
        # ignore_eos suppresses EOS (llama.cpp --ignore-eos, transformers min_new_tokens): the stream then
        # holds exactly max_new_tokens real tokens instead of EOS followed by noise.
        banned_rows = [i for i, r in enumerate(reqs) if r.params.ignore_eos]
        if banned_rows and self.eos_token_ids:
            rows = torch.tensor(banned_rows, device=logits.device)[:, None]
            cols = torch.tensor(sorted(self.eos_token_ids), device=logits.device)[None, :]
            logits[rows, cols] = float("-inf")

    def _append_tokens(self, reqs: list[Request], next_ids: list[int]) -> None:
        now = time.perf_counter()
        for req, token_id in zip(reqs, next_ids):
            req.output_ids.append(token_id)
            m = req.metrics
            m.num_generated_tokens = len(req.output_ids)
            if m.first_token_time is None:
                m.first_token_time = now
            m.kv_bytes = max(m.kv_bytes, self.kv.kv_bytes_in_use(req.seq_id))
            reason = req.stop_reason_after(token_id, self.max_model_len)
            decoder = self._decoders.get(req.request_id)
            text = decoder.push(token_id) if decoder is not None else ""
            if reason is not None:
                text += decoder.flush() if decoder is not None else ""
                self._finish(req, reason, emit=False)
            self._events.append(TokenEvent(req.request_id, token_id, text, reason))

    def _finish(self, req: Request, reason: FinishReason, error: KVCoreError | None = None, emit: bool = True) -> None:
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        self.scheduler.remove(req)
        if emit:
            self._events.append(TokenEvent(req.request_id, None, "", reason, error))

    # -- conveniences --------------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run a batch of prompts (any lengths) to completion; results in prompt order."""
        prompts = list(prompts)
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(per)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, per):
                ids.append(self.add_request(prompt, p))
        except KVCoreError:
            for rid in ids:  # leave the engine as we found it
                self.abort(rid)
                self.release(rid)
            raise
        while any(not self._requests[r].is_finished for r in ids):
            self.step()
        return [self.release(r) for r in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[TokenEvent]:
        """Yield one :class:`TokenEvent` per generated token of a single request."""
        rid = self.add_request(prompt, params)
        try:
            while not self._requests[rid].is_finished:
                for event in self.step():
                    if event.request_id == rid:
                        yield event
        finally:
            self.abort(rid)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
