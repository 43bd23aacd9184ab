"""The generation driver: prefill + decode over any backend, cache and sampler, with continuous batching.

Each :meth:`Engine.step` either prefills newly admitted requests (their whole prompts in one packed
forward; the first token comes from each prompt's last position) or runs one decode step for every
running request (one query row each, attending to the whole cache). Requests join the running batch
as soon as the cache has room and leave it the step they finish, giving their cache storage back.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.attention import AttentionBackend
from kvcore.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    KVCoreError,
    OutOfBlocksError,
    RequestAbortedError,
)
from kvcore.kv_cache import CacheSpec, KVCache, create_cache
from kvcore.model import LlamaModel
from kvcore.plugins import BackendRegistry, get_registry
from kvcore.request import FinishReason, GenerationResult, Request, TokenEvent
from kvcore.sampling import DefaultSampler, Sampler, SamplingParams

__all__ = ["EngineConfig", "Engine", "parse_dtype", "select_backends"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(str(name), str(name))
    if key not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}' (choose from: {', '.join(DTYPES)})")
    return DTYPES[key]


@dataclass
class EngineConfig:
    """How the engine runs. Backend names ``None`` mean "pick the best available"."""

    backend: str | None = None  # both phases
    prefill_backend: str | None = None  # overrides ``backend`` for prefill
    decode_backend: str | None = None  # overrides ``backend`` for decode
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 8  # requests resident in the KV cache at once
    max_model_len: int | None = None  # tokens per request; None = the model's context window, capped
    block_size: int = 16  # paged caches: tokens per block
    num_blocks: int | None = None  # paged caches: pool size; None = max_num_seqs × max_model_len worth
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # [backends.<name>] tables

    #: default cap on max_model_len so a contiguous cache does not reserve the full 8K window per slot
    DEFAULT_MAX_MODEL_LEN = 4096

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ConfigError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"unknown device '{self.device}' (examples: cpu, cuda, cuda:1)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device '{self.device}' is not available: torch.cuda.is_available() is False")


def select_backends(
    registry: BackendRegistry,
    config: EngineConfig,
    *,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[AttentionBackend, AttentionBackend, str]:
    """Resolve (prefill backend, decode backend, shared cache kind), or raise with the reason."""
    device, dtype = torch.device(config.device), parse_dtype(config.dtype)
    shape = dict(device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)

    def make(name: str) -> AttentionBackend:
        backend = registry.create(name, config.backend_options.get(name))
        reasons = backend.validate(**shape)
        if reasons:
            raise BackendUnavailableError(f"backend '{name}' cannot run this model here: {'; '.join(reasons)}")
        return backend

    def auto() -> str:
        usable = []
        for entry in registry.backends.values():
            if entry.availability() is None and not entry.cls.capabilities.reasons_unsupported(**shape):
                usable.append(entry)
        if not usable:
            raise BackendUnavailableError(f"no registered backend supports {dtype} on {device.type}")
        return max(usable, key=lambda e: (e.cls.priority, e.name)).name

    prefill_name = config.prefill_backend or config.backend or auto()
    decode_name = config.decode_backend or config.backend or prefill_name
    prefill = make(prefill_name)
    decode = prefill if decode_name == prefill_name else make(decode_name)
    if not prefill.capabilities.supports_prefill:
        raise ConfigError(f"backend '{prefill_name}' cannot run prefill")
    if not decode.capabilities.supports_decode:
        raise ConfigError(f"backend '{decode_name}' cannot run decode")
    shared = [k for k in decode.capabilities.cache_kinds if k in prefill.capabilities.cache_kinds]
    if not shared:
        raise ConfigError(
            f"prefill backend '{prefill_name}' (reads {'/'.join(prefill.capabilities.cache_kinds)} caches) and "
            f"decode backend '{decode_name}' (reads {'/'.join(decode.capabilities.cache_kinds)} caches) "
            "share no KV-cache layout; pick a compatible pair"
        )
    return prefill, decode, shared[0]


class Engine:
    """Runs requests through a model with a chosen attention backend per phase.

    Use :meth:`add_request` + :meth:`step` (a serving loop), or the conveniences :meth:`generate` and
    :meth:`stream`.
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
        *,
        registry: BackendRegistry | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.sampler = sampler or DefaultSampler()
        mc = model.config
        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(config.device)
        if model.dtype != self.dtype:
            raise ConfigError(f"model weights are {model.dtype} but the engine was configured for {self.dtype}")
        self.prefill_backend, self.decode_backend, cache_kind = select_backends(
            registry or get_registry(),
            config,
            head_dim=mc.head_dim,
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
        )
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
        owner = next(
            (b for b in (self.decode_backend, self.prefill_backend) if b.capabilities.cache_kinds[0] == cache_kind),
            None,
        )
        self.cache: KVCache = owner.create_cache(spec) if owner else create_cache(cache_kind, spec)
        self.scale = mc.head_dim**-0.5
        eos = set(mc.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", []) or [])
        self.eos_token_ids = frozenset(eos)

        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._decoders: dict[str, Any] = {}
        self._events: list[TokenEvent] = []  # what the current step() reports
        self._ids = itertools.count()
        self._seq_ids = itertools.count()

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
        generator = None
        if not params.is_greedy:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
        req = Request(request_id, prompt_ids, params, self.eos_token_ids, generator=generator)
        req.metrics.num_prompt_tokens = len(prompt_ids)
        self._requests[request_id] = req
        self._waiting.append(req)
        if self.tokenizer is not None:
            self._decoders[request_id] = self.tokenizer.stream_decoder()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its cache storage is freed and other requests are unaffected."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        if req in self._waiting:
            self._waiting.remove(req)
        # The caller asked for it, so no event: the previous step's event list stays as it was returned.
        self._finish(req, FinishReason.ABORT, RequestAbortedError(f"request '{request_id}' was aborted"), emit=False)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

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
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        elif self._running:
            self._decode()
        return self._events

    def _admit(self) -> list[Request]:
        admitted = []
        while self._waiting and len(self._running) + len(admitted) < self.config.max_num_seqs:
            req = self._waiting[0]
            if not self.cache.can_add_sequence():
                break
            seq_id = next(self._seq_ids)
            self.cache.add_sequence(seq_id)
            # Count the whole prefill batch together: each may fit alone but not all at once.
            batch_ids = [r.seq_id for r in admitted] + [seq_id]
            batch_lens = [len(r.all_ids) for r in admitted] + [len(req.all_ids)]
            if not self.cache.can_prepare(batch_ids, batch_lens):
                self.cache.free_sequence(seq_id)
                if not self._running and not admitted:  # alone and still too big: it can never run
                    self._waiting.popleft()
                    self._finish(req, FinishReason.ERROR, OutOfBlocksError(
                        f"request '{req.request_id}' needs {len(req.all_ids)} tokens of KV cache, more than the "
                        "whole cache holds; raise num_blocks or shorten the prompt"))
                    continue
                break
            req.seq_id = seq_id
            self._waiting.popleft()
            admitted.append(req)
        return admitted

    def _run_batch(self, reqs: list[Request], forward: Callable[[], None], backend: AttentionBackend) -> None:
        """Run one forward for ``reqs``; if it raises, those requests fail (and free their cache)
        while every other request, waiting or running, is untouched."""
        try:
            forward()
        except KVCoreError as exc:
            for req in reqs:
                self._finish(req, FinishReason.ERROR, exc)
        except Exception as exc:
            error = BackendError(f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            for req in reqs:
                self._finish(req, FinishReason.ERROR, error)

    def _prefill(self, reqs: list[Request]) -> None:
        self._run_batch(reqs, lambda: self._prefill_forward(reqs), self.prefill_backend)

    def _prefill_forward(self, reqs: list[Request]) -> None:
        # A preempted request re-enters with prompt + generated so far (recompute).
        chunks = [r.all_ids for r in reqs]
        meta = self.cache.prepare([r.seq_id for r in reqs], [len(c) for c in chunks], self.scale)
        input_ids = torch.tensor(list(itertools.chain.from_iterable(chunks)), dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.cache, self.prefill_backend)  # (T, d)
        last_rows = (meta.cu_seqlens_q[1:] - 1).long()
        logits = self.model.compute_logits(hidden[last_rows])  # (B, V)
        self._running.extend(reqs)
        self._sample_and_update(reqs, logits)

    def _decode(self) -> None:
        self._make_room()
        reqs = list(self._running)
        if reqs:
            self._run_batch(reqs, lambda: self._decode_forward(reqs), self.decode_backend)

    def _decode_forward(self, reqs: list[Request]) -> None:
        meta = self.cache.prepare([r.seq_id for r in reqs], [1] * len(reqs), self.scale)
        input_ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.cache, self.decode_backend)  # (B, d)
        self._sample_and_update(reqs, self.model.compute_logits(hidden))

    def _make_room(self) -> None:
        """Preempt the newest running requests until every remaining one can append a token."""
        while self._running:
            if self.cache.can_prepare([r.seq_id for r in self._running], [1] * len(self._running)):
                return
            victim = self._running[-1]
            if len(self._running) == 1:
                self._finish(victim, FinishReason.ERROR, OutOfBlocksError(
                    f"request '{victim.request_id}' ran out of KV-cache blocks at {len(victim.all_ids)} tokens"))
                continue
            # Recompute-style preemption: drop its cache, requeue it first; its stream is unchanged.
            self._running.remove(victim)
            self.cache.free_sequence(victim.seq_id)
            victim.seq_id = None
            victim.metrics.num_preemptions += 1
            self._waiting.appendleft(victim)

    def _sample_and_update(self, reqs: list[Request], logits: torch.Tensor) -> None:
        banned_rows = [i for i, r in enumerate(reqs) if r.params.ignore_eos]
        if banned_rows and self.eos_token_ids:
            # ignore_eos suppresses EOS (llama.cpp --ignore-eos, transformers min_new_tokens): the stream
            # then holds exactly max_new_tokens real tokens instead of EOS followed by noise.
            rows = torch.tensor(banned_rows, device=logits.device)[:, None]
            cols = torch.tensor(sorted(self.eos_token_ids), device=logits.device)[None, :]
            logits[rows, cols] = float("-inf")
        next_ids = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        now = time.perf_counter()
        for req, token_id in zip(reqs, next_ids):
            req.output_ids.append(token_id)
            m = req.metrics
            m.num_generated_tokens = len(req.output_ids)
            if m.first_token_time is None:
                m.first_token_time = now
            m.kv_bytes = max(m.kv_bytes, self.cache.kv_bytes_in_use(req.seq_id))
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
        if req in self._running:
            self._running.remove(req)
        if req.seq_id is not None:
            self.cache.free_sequence(req.seq_id)
            req.seq_id = None
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
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
