"""Timing one generation run, on kvcore's engine (:func:`kv_run`) or on transformers (:func:`hf_run`).

Both return a :class:`RunStats` built by the same :func:`run_stats`, so the two sides' figures mean the same:
TTFT = request arrival to its first token; TPOT = mean time per output token after the first; decode
tokens/s = tokens after the first / time after the first token (summed over the requests); peak RSS = the
process's resident-set high-water mark during the run (Linux).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunStats", "build_transformers_model", "hf_run", "kv_run", "run_stats"]


@dataclass
class RunStats:
    """One generation run of ``B`` requests (kvcore or transformers)."""

    ttft_s: float  # mean over the requests
    tpot_s: float | None  # mean over the requests
    decode_tok_s: float | None  # tokens after each request's first / (last token time - first token time)
    token_ids: list[list[int]]
    wall_s: float
    peak_rss_mib: float | None = None
    kv_bytes_allocated: int | None = None
    kv_bytes_peak: int | None = None  # peak of the cache's bytes holding live tokens
    step_times_s: list[float] = field(default_factory=list)  # decode step intervals (kvcore)
    extra: dict[str, Any] = field(default_factory=dict)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
            f.write("5")
    except OSError:
        pass


def _peak_rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except Exception:  # pragma: no cover - non-POSIX
        return None


def kv_run(engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> RunStats:
    """Submit ``prompts`` together, step the engine to completion, and time every token event."""
    from kvcore.interfaces.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    _reset_peak_rss()
    start = time.perf_counter()
    ids = [engine.add_request(list(p), params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    step_ends, kv_peak = [], 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        step_ends.append(now)
        kv_peak = max(kv_peak, engine.kv.kv_bytes_in_use())
        for event in events:
            if event.token_id is not None:
                times[event.request_id].append(now)
    wall = time.perf_counter() - start
    results = [engine.release(rid) for rid in ids]
    for r in results:
        if r.error is not None:
            raise r.error
    stats = run_stats(
        ttfts=[r.metrics.ttft_s for r in results],
        token_times=[times[rid] for rid in ids],
        token_ids=[r.token_ids for r in results],
        wall=wall,
        peak_rss=_peak_rss_mib(),
        kv_alloc=engine.cache.kv_bytes_allocated,
        kv_peak=kv_peak,
        step_times=[b - a for a, b in zip(step_ends[1:], step_ends[2:])],
    )
    stats.extra["cached_prompt_tokens"] = sum(r.metrics.num_cached_tokens for r in results)
    return stats


def run_stats(ttfts, token_times, token_ids, wall, peak_rss=None, kv_alloc=None, kv_peak=None, step_times=()):
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    after_first = sum(len(t) - 1 for t in token_times)
    first, last = min(t[0] for t in token_times), max(t[-1] for t in token_times)
    return RunStats(
        ttft_s=statistics.fmean(ttfts),
        tpot_s=statistics.fmean(tpots) if tpots else None,
        decode_tok_s=after_first / (last - first) if after_first and last > first else None,
        token_ids=token_ids,
        wall_s=wall,
        peak_rss_mib=peak_rss,
        kv_bytes_allocated=kv_alloc,
        kv_bytes_peak=kv_peak,
        step_times_s=list(step_times),
    )


def hf_run(model, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int) -> RunStats:
    """``model.generate`` (greedy, EOS suppressed) on left-padded prompts; a streamer timestamps every step."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    clock = Clock()
    _reset_peak_rss()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, streamer=clock, pad_token_id=pad_id,
        )
    wall = time.perf_counter() - start
    steps = clock.times[1:]  # the first put is the prompt itself
    return run_stats(
        ttfts=[steps[0] - start] * len(prompts),
        token_times=[steps] * len(prompts),
        token_ids=out[:, width:].tolist(),
        wall=wall,
        peak_rss=_peak_rss_mib(),
        step_times=[b - a for a, b in zip(steps, steps[1:])],
    )


def build_transformers_model(loaded, dtype):
    """transformers' ``LlamaForCausalLM`` holding exactly ``loaded``'s dequantized weights (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = loaded.config
    eos = c.eos_token_ids[0] if c.eos_token_ids else 0
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=eos,
        pad_token_id=eos, attn_implementation="sdpa",
    )
    with torch.device("meta"):  # no random init: every parameter is assigned below
        model = LlamaForCausalLM(hf_config)
    state = {name: w.to(dtype) for name, w in loaded.weights.items()}  # float32: the same tensors, no copy
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hf_config)  # its inv_freq buffer was on meta
    model.eval()
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = eos, eos, c.bos_token_id
    return model

