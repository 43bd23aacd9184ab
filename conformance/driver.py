"""Running a model: through the real :class:`~kvcore.engine.core.Engine` (stream and sampling tiers), or call by
call over a cache (cache tier)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.conformance.limits import generate, steps
from kvcore.conformance.models import ConformanceModel
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.engine.core import Engine, EngineConfig
from kvcore.execution.runner import last_token_logits
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.sampler import Sampler, SamplingParams, SamplingRow
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = [
    "Stream", "RecordingSampler", "run_engine", "run_churn", "ChurnRequest", "cache_spec", "forward_logits",
    "recurring_shapes",
]


@dataclass
class Stream:
    tokens: list[int]
    logits: torch.Tensor  # [steps, V] float32 on CPU: the logits each token was picked from


class RecordingSampler(Sampler):
    """Wraps the sampler under test and keeps every row's logits, per request id."""

    name = "conformance-recorder"

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.batches: list[tuple[int, ...]] = []  # per call: each row's length (prompt + output so far)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        self.batches.append(tuple(len(r.prompt_ids) + len(r.output_ids) for r in rows))
        for i, row in enumerate(rows):
            self.rows[row.request_id].append(logits[i].detach().float().cpu())
        return self.inner.sample(logits, rows)


def run_engine(
    target: Target,
    cm: ConformanceModel,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    cfg: SuiteConfig,
    *,
    sampler: Sampler | None = None,
    max_num_seqs: int | None = None,
    compile: bool = False,
) -> list[Stream]:
    """Generate ``prompts`` with ``target``'s backend for both phases over its (first) cache; together in
    one ragged batch unless ``max_num_seqs`` limits how many run at once (requests then join and leave);
    ``compile``: decode steps through torch.compile (``EngineConfig.compile``)."""
    longest = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
    cache = target.cache_names()[0]
    config = EngineConfig(
        backend=target.name,
        kv_cache=cache,
        dtype=cfg.dtype_name,
        weights="float",  # the suite certifies backends against float references: never the automatic formats
        lm_head="dense",
        device=cfg.device,
        max_num_seqs=max_num_seqs or len(prompts),
        max_model_len=min(longest + 16, cm.config.max_position_embeddings),
        backend_options={target.name: dict(target.options)} if target.options else {},
        kv_cache_options={cache: dict(target.kv_cache_options)} if cache == target.kv_cache else {},
        tensor_parallel_size=cfg.tensor_parallel_size,
        check_backend_outputs=False,  # the suite measures and reports every divergence itself
        compile=compile,
        attention_variants=cfg.attention_variants,
    )
    recorder = RecordingSampler(sampler or target.make_sampler())
    engine = Engine(cm.model, None, config, registry=target.registry, sampler=recorder)
    try:
        results = generate(engine, prompts, params)
    finally:
        engine.close()  # stops tensor-parallel workers now, not when the engine is collected
    streams = []
    for res in results:
        if res.error is not None:
            raise res.error
        rows = recorder.rows[res.request_id]
        logits = torch.stack(rows) if rows else torch.empty(0, cm.config.vocab_size)
        streams.append(Stream(list(res.token_ids), logits))
    return streams


@dataclass(frozen=True)
class ChurnRequest:
    prompt: tuple[int, ...]
    max_new_tokens: int
    join_step: int  # engine step before which it is added


def run_churn(
    target: Target, cm: ConformanceModel, requests: Sequence[ChurnRequest], cfg: SuiteConfig, *,
    max_num_seqs: int, num_blocks_tokens: int,
) -> tuple[list[Stream], dict]:
    """Continuous batching on one long-lived engine (one backend instance): each request joins before its
    ``join_step``; at most ``max_num_seqs`` run at once; a paged cache gets a pool of about
    ``num_blocks_tokens`` tokens (never less than the longest request), so running requests are preempted
    and recomputed. Greedy. Returns each request's stream and facts (steps, preemptions, block size)."""
    cache = target.cache_names()[0]
    options = dict(target.kv_cache_options) if cache == target.kv_cache else {}
    block_size = int(options.get("block_size", 8))
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    num_blocks = max(-(-num_blocks_tokens // block_size), -(-longest // block_size) + 1)
    config = EngineConfig(
        backend=target.name, kv_cache=cache, dtype=cfg.dtype_name, weights="float", lm_head="dense", device=cfg.device,
        max_num_seqs=max_num_seqs, max_model_len=longest + 16, block_size=block_size, num_blocks=num_blocks,
        backend_options={target.name: dict(target.options)} if target.options else {},
        kv_cache_options={cache: options} if options else {},
        check_backend_outputs=False,  # the suite measures and reports every divergence itself
        attention_variants=cfg.attention_variants,
    )
    recorder = RecordingSampler(target.make_sampler())
    engine = Engine(cm.model, None, config, registry=target.registry, sampler=recorder)
    ids: list[str | None] = [None] * len(requests)
    step, run = 0, steps(sum(len(r.prompt) + r.max_new_tokens for r in requests))
    while None in ids or engine.has_unfinished():
        next(run)
        for i, r in enumerate(requests):
            if ids[i] is None and r.join_step <= step:
                params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
                ids[i] = engine.add_request(list(r.prompt), params, request_id=f"churn-{i}")
        engine.step()
        step += 1
    streams, preemptions = [], 0
    for rid in ids:
        res = engine.result(rid)
        if res.error is not None:
            raise res.error
        preemptions += res.metrics.num_preemptions
        rows = recorder.rows[rid]
        logits = torch.stack(rows) if rows else torch.empty(0, cm.config.vocab_size)
        streams.append(Stream(list(res.token_ids), logits))
    facts = {"engine_steps": step, "preemptions": preemptions, "max_num_seqs": max_num_seqs,
             "paged": engine.cache.paged, "num_blocks": num_blocks if engine.cache.paged else None,
             "recurring_shapes": recurring_shapes(recorder.batches)}
    return streams, facts


def recurring_shapes(batches: Sequence[tuple[int, ...]]) -> int:
    """How many calls had a shape (batch size, longest row) seen before with other per-row lengths."""
    seen: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    count = 0
    for lens in batches:
        shape = (len(lens), max(lens))
        earlier = seen.setdefault(shape, set())
        count += bool(earlier - {lens})
        earlier.add(lens)
    return count


def cache_spec(cm: ConformanceModel, cfg: SuiteConfig, num_seqs: int, max_len: int, block_size: int = 16) -> CacheSpec:
    c = cm.config
    return CacheSpec(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=cfg.dtype,
        device=cfg.torch_device,
        max_num_seqs=num_seqs,
        max_seq_len=max_len,
        block_size=block_size,
    )


@torch.inference_mode()
def forward_logits(
    cm: ConformanceModel,
    backend: AttentionBackend,
    kv: KVCacheManager,
    seq_ids: Sequence[int],
    chunks: Sequence[Sequence[int]],
) -> torch.Tensor:
    """One packed forward of ``chunks[i]`` appended to sequence ``seq_ids[i]``; ``[B, V]`` float32 logits of
    each chunk's last token."""
    meta = kv.prepare(list(seq_ids), [len(c) for c in chunks], cm.model.attention_scale, cm.model.attention_layers)
    input_ids = [t for c in chunks for t in c]
    return last_token_logits(cm.model, backend, kv.cache, meta, input_ids).float().cpu()
