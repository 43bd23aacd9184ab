"""The cases of ``kvcore bench`` that are more than one :meth:`~kvcore_bench.harness.Harness.compare`: KV
capacity under a byte budget, inter-token gaps under chunked prefill, n-gram speculation, and decode step
time against context length. Each takes the harness and returns its section of the report.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvcore_bench.common import median
from kvcore_bench.harness import Harness
from kvcore_bench.runs import hf_run, kv_run
from kvcore_bench.settings import TARGET_BACKEND

__all__ = ["capacity", "chunked", "scaling", "speculative"]


def capacity(h: Harness) -> dict[str, Any]:
    """Concurrency under one KV byte budget: contiguous (max_model_len per slot) vs paged (blocks)."""
    import torch

    contiguous = next((b for b in ("sdpa", "naive") if b in h.s.backends), "sdpa")
    max_len = min(1024 if h.s.quick else 2048, h.loaded.config.max_position_embeddings)
    slots, block_size = 4, 16
    num_requests = 16 if h.s.quick else 24
    new_tokens = 4 if h.s.quick else 8
    cfg = h.loaded.config
    bytes_per_token = cfg.kv_bytes_per_token(4)
    budget = slots * max_len * bytes_per_token
    # mixed lengths: spread evenly over [max_len / 32, max_len / 4]
    lo, hi = max(2, max_len // 32), max_len // 4
    lengths = [lo + (hi - lo) * i // (num_requests - 1) for i in range(num_requests)]
    order = sorted(range(num_requests), key=lambda i: (i * 7) % num_requests)  # interleave short and long
    prompts = [h.prompt(lengths[i], salt=i) for i in order]
    engines = {
        f"contiguous ({contiguous})": h.engine(contiguous, torch.float32, max_num_seqs=slots,
                                                   max_model_len=max_len),
        "paged": h.engine("paged", torch.float32, max_num_seqs=num_requests, max_model_len=max_len,
                             block_size=block_size, num_blocks=budget // (block_size * bytes_per_token)),
    }
    result: dict[str, Any] = {
        "kv_budget_bytes": budget, "max_model_len": max_len, "requests": num_requests,
        "prompt_lengths": [lengths[i] for i in order], "new_tokens": new_tokens, "caches": {},
    }
    for label, eng in engines.items():
        if eng.cache.kv_bytes_allocated > budget:
            raise AssertionError(f"{label} cache exceeds the budget")  # pragma: no cover - a bug
        stats = _capacity_run(eng, prompts, new_tokens)
        stats["kv_bytes_allocated"] = eng.cache.kv_bytes_allocated
        result["caches"][label] = stats
        h.log(f"capacity: {label}: {stats['max_concurrent']} concurrent, {stats['wall_s']:.1f}s")
    c, p = (result["caches"][k]["max_concurrent"] for k in engines)
    result["ratio"] = p / c
    return result


def _capacity_run(engine, prompts, new_tokens) -> dict[str, Any]:
    from kvcore.interfaces.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    concurrency, kv_peak = [], 0
    while engine.has_unfinished():
        engine.step()
        concurrency.append(engine.gauges().num_running)
        kv_peak = max(kv_peak, engine.kv.kv_bytes_in_use())
    wall = time.perf_counter() - start
    results = [engine.release(rid) for rid in ids]
    generated = sum(len(r.token_ids) for r in results)
    return {
        "max_concurrent": max(concurrency),
        "mean_concurrent": round(statistics.fmean(concurrency), 2),
        "steps": len(concurrency),
        "preemptions": sum(r.metrics.num_preemptions for r in results),
        "errors": sum(r.error is not None for r in results),
        "kv_bytes_peak_in_use": kv_peak,
        "wall_s": round(wall, 2),
        "generated_tok_s": round(generated / wall, 2),
    }


def chunked(h: Harness) -> dict[str, Any]:
    """Inter-token gaps of running requests while a long prompt is admitted: chunked vs whole prefill.
    Both modes alternate per repetition; figures are medians over repetitions."""
    import torch

    backend = TARGET_BACKEND if TARGET_BACKEND in h.s.backends else h.s.backends[0]
    length = min(h.s.long_context, h.window(16))
    budget = max(16, length // 16)  # the 2048-token prompt in 16 chunks of 128 (minus the 4 decode rows)
    runs: dict[str, list[dict[str, float]]] = {"whole": [], "chunked": []}
    for rep in range(h.s.reps_long):
        for label in ("whole", "chunked") if rep % 2 == 0 else ("chunked", "whole"):
            chunked = label == "chunked"
            eng = h.engine(backend, torch.float32, max_num_seqs=5, max_model_len=length + 16,
                              enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 8192)
            runs[label].append(_gap_run(h, eng, length, budget))
            r = runs[label][-1]
            h.log(f"chunked: {label}: worst gap {r['worst_gap_s']:.3f}s wall, {r['worst_gap_cpu_s']:.2f}s CPU")
    result: dict[str, Any] = {"backend": backend, "prompt_tokens": length, "budget": budget, "modes": {}}
    for label, stats in runs.items():
        result["modes"][label] = {k: median([r[k] for r in stats]) for k in stats[0]}
    c, w = result["modes"]["chunked"], result["modes"]["whole"]
    result["ratio_wall"] = c["worst_gap_s"] / w["worst_gap_s"]
    result["ratio"] = c["worst_gap_cpu_s"] / w["worst_gap_cpu_s"]  # robust to load from other processes
    return result


def speculative(h: Harness) -> dict[str, Any]:
    """Batch-1 decode with n-gram speculation vs without (float32, alternating per repetition): a random
    token sequence given two and a half times, which the model goes on copying."""
    import torch

    from kvcore.interfaces.sampler import SamplingParams

    backend = TARGET_BACKEND if TARGET_BACKEND in h.s.backends else h.s.backends[0]
    n = h.s.num_new_tokens
    x = h.prompt(max(8, min(200, (h.window(n) - n) * 2 // 5)), salt=11)
    prompt = x + x + x[: len(x) // 2]
    runs: dict[str, list[dict[str, float]]] = {"base": [], "ngram": []}
    for rep in range(h.s.reps_short):
        for label in ("base", "ngram") if rep % 2 == 0 else ("ngram", "base"):
            extra = {"proposer": "ngram"} if label == "ngram" else {}
            eng = h.engine(backend, torch.float32, max_num_seqs=1, max_model_len=len(prompt) + n + 8, **extra)
            r = eng.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
            m = r.metrics
            runs[label].append({"decode_tok_s": m.tokens_per_s or 0.0, "draft_tokens": m.num_draft_tokens,
                                "accepted_tokens": m.num_accepted_tokens,
                                "acceptance_rate": m.acceptance_rate or 0.0,
                                "mean_accepted_length": m.mean_accepted_length or 0.0,
                                "tokens_per_step": m.tokens_per_step or 1.0})
    modes = {label: {k: median([r[k] for r in stats]) for k in stats[0]} for label, stats in runs.items()}
    result = {"backend": backend, "prompt_tokens": len(prompt), "new_tokens": n, "modes": modes,
              "speedup": modes["ngram"]["decode_tok_s"] / max(modes["base"]["decode_tok_s"], 1e-9)}
    h.log(f"speculative: x{result['speedup']:.2f}, acceptance {modes['ngram']['acceptance_rate']:.2f}")
    return result


def _gap_run(h: Harness, engine, length: int, budget: int) -> dict[str, float]:
    from kvcore.interfaces.sampler import SamplingParams

    short = SamplingParams(max_new_tokens=8 + length // (budget - 8), ignore_eos=True)
    ids = [engine.add_request(h.prompt(32, salt=5 * i), short) for i in range(4)]
    for _ in range(4):  # prefill them, then steady decoding
        engine.step()
    # Wall clock is what a user feels; this process's CPU time is the same measure with the time other
    # processes take from a shared machine left out (on an idle machine the two ratios agree).
    last = dict.fromkeys(ids, (time.perf_counter(), time.process_time()))
    long_id = engine.add_request(h.prompt(length, salt=3), SamplingParams(max_new_tokens=2, ignore_eos=True))
    arrival, ttft, gaps, cpu_gaps, waited = time.perf_counter(), None, [], [], set()
    while (ttft is None or len(waited) < len(ids)) and engine.has_unfinished():
        events = engine.step()
        now = (time.perf_counter(), time.process_time())
        for e in events:
            if e.request_id == long_id:
                ttft = now[0] - arrival
            elif e.request_id in last:
                gaps.append(now[0] - last[e.request_id][0])
                cpu_gaps.append(now[1] - last[e.request_id][1])
                last[e.request_id] = now
                waited.add(e.request_id)
    for rid in [*ids, long_id]:
        engine.abort(rid)
        engine.release(rid)
    return {"worst_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_ttft_s": ttft,
            "worst_gap_cpu_s": max(cpu_gaps)}


def scaling(h: Harness) -> dict[str, dict[int, float]]:
    """Median decode step time of one sequence at each context length, per backend.

    Every (backend, context) pair gets its own engine holding one prefilled request; then rounds of
    a few timed decode steps visit every pair in turn, so a burst of load from elsewhere on the
    machine hits all contexts alike instead of skewing one point of the curve.
    """
    import torch

    from kvcore.interfaces.sampler import SamplingParams

    rounds, per_round = (3, 2) if h.s.quick else (5, 3)
    steps = rounds * per_round
    contexts = sorted({min(c, h.window(steps + 2)) for c in h.s.context_lengths})
    pairs = {}
    result: dict[str, dict[int, float]] = {}
    for name in h.s.backends:
        for ctx in contexts:
            max_len = ctx + steps + 8
            if _cache_kind(name) == "contiguous" and name != "sdpa" and "sdpa" in _registry_names():
                # only decode is timed: let the fast backend build the context
                eng = h.engine(None, torch.float32, prefill_backend="sdpa", decode_backend=name,
                                  max_num_seqs=1, max_model_len=max_len)
            else:
                eng = h.engine(name, torch.float32, max_num_seqs=1, max_model_len=max_len)
            kv_run(eng, [h.prompt(8)], 3)  # warm-up
            rid = eng.add_request(h.prompt(ctx), SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
            eng.step()  # prefill (untimed)
            eng.step()  # first decode step (untimed)
            pairs[name, ctx] = (eng, rid, [])
        h.log(f"scaling: {name}: contexts {', '.join(map(str, contexts))} prefilled")
    for _ in range(rounds):
        for eng, _, times in pairs.values():
            for _ in range(per_round):
                start = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - start)
    for (name, ctx), (eng, rid, times) in pairs.items():
        eng.abort(rid)
        eng.release(rid)
        result.setdefault(name, {})[ctx] = statistics.median(times)
    for name, series in result.items():
        h.log(f"scaling: {name}: " + ", ".join(f"{c}: {t * 1e3:.1f} ms" for c, t in series.items()))
    pairs.clear()
    hf = None if h.s.quick else h.hf_model(torch.float32)
    if hf is not None:  # generate() cannot be paused: one run per context (informational line)
        hf_run(hf, [h.prompt(16)], 3, h.pad_id)
        series = {}
        for ctx in contexts:
            stats = hf_run(hf, [h.prompt(ctx)], 8, h.pad_id)
            series[ctx] = statistics.median(stats.step_times_s)
            h.log(f"scaling: transformers ctx {ctx}: {series[ctx] * 1e3:.1f} ms/step")
        result["transformers"] = series
    return result


def _registry_names() -> list[str]:
    from kvcore.plugins.registry import get_registry

    return list(get_registry().backends)


def _cache_kind(name: str) -> str:
    from kvcore.plugins.registry import get_registry

    return get_registry().backends[name].cls.capabilities.kv_layouts[0]

