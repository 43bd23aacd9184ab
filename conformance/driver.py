"""Running a model: through the real :class:`~kvcore.engine.Engine` (stream and sampling tiers), or call by
call over a cache (cache tier)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.attention import AttentionBackend
from kvcore.conformance.models import ConformanceModel
from kvcore.conformance.settings import SuiteConfig
from kvcore.engine import Engine, EngineConfig
from kvcore.kv_cache import CacheSpec, KVCache
from kvcore.plugins import BackendRegistry
from kvcore.sampling import DefaultSampler, SamplingParams

__all__ = ["Stream", "RecordingSampler", "run_engine", "cache_spec", "forward_logits"]


@dataclass
class Stream:
    tokens: list[int]
    logits: torch.Tensor  # [steps, V] float32 on CPU: the logits each token was picked from


class RecordingSampler(DefaultSampler):
    """The default sampler, keeping every row's logits. Rows are told apart by ``params.seed``, which the
    suite sets to a distinct tag per request (greedy requests ignore it)."""

    def __init__(self) -> None:
        self.rows: dict[int | None, list[torch.Tensor]] = defaultdict(list)

    def sample(self, logits, params, generators):
        ids = super().sample(logits, params, generators)
        for row, p in enumerate(params):
            self.rows[p.seed].append(logits[row].detach().float().cpu())
        return ids


def run_engine(
    registry: BackendRegistry,
    backend_name: str,
    cm: ConformanceModel,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    cfg: SuiteConfig,
    options: dict | None = None,
) -> list[Stream]:
    """Generate ``prompts`` together (one ragged batch) with ``backend_name`` for both phases."""
    tags = [p.seed for p in params]
    assert len(set(tags)) == len(tags), "each request needs a distinct seed tag"
    longest = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
    config = EngineConfig(
        backend=backend_name,
        dtype=cfg.dtype_name,
        device=cfg.device,
        max_num_seqs=len(prompts),
        max_model_len=min(longest + 16, cm.config.max_position_embeddings),
        backend_options={backend_name: dict(options)} if options else {},
    )
    sampler = RecordingSampler()
    engine = Engine(cm.model, None, config, registry=registry, sampler=sampler)
    results = engine.generate([list(p) for p in prompts], list(params))
    streams = []
    for res, tag in zip(results, tags):
        if res.error is not None:
            raise res.error
        rows = sampler.rows[tag]
        logits = torch.stack(rows) if rows else torch.empty(0, cm.config.vocab_size)
        streams.append(Stream(list(res.token_ids), logits))
    return streams


def cache_spec(cm: ConformanceModel, cfg: SuiteConfig, num_seqs: int, max_len: int) -> CacheSpec:
    c = cm.config
    return CacheSpec(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=cfg.dtype,
        device=cfg.torch_device,
        max_num_seqs=num_seqs,
        max_seq_len=max_len,
        block_size=16,
    )


@torch.inference_mode()
def forward_logits(
    cm: ConformanceModel,
    backend: AttentionBackend,
    cache: KVCache,
    seq_ids: Sequence[int],
    chunks: Sequence[Sequence[int]],
) -> torch.Tensor:
    """One packed forward of ``chunks[i]`` appended to sequence ``seq_ids[i]``; ``[B, V]`` float32 logits of
    each chunk's last token."""
    meta = cache.prepare(list(seq_ids), [len(c) for c in chunks], cm.config.head_dim**-0.5)
    device = cache.spec.device
    input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
    hidden = cm.model(input_ids, meta, cache, backend)
    last = (meta.cu_seqlens_q[1:] - 1).long()
    return cm.model.compute_logits(hidden[last]).float().cpu()
