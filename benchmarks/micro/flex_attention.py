"""The ``flex`` backend (FlexAttention, compiled) against ``sdpa`` and ``cpu_decode``: one layer's attention call,
and what compiling costs the first process and a second one.

    python benchmarks/micro/flex_attention.py [--dtype float32] [--threads 2] [--rounds 5]

SmolLM2's attention shape (9 query heads on 3 KV heads, head_dim 64) on a contiguous cache, through each backend's
``plan`` and ``forward`` as the engine calls them: a 2048-token prefill of one sequence, and a decode step of one
sequence at 2048 keys of context. The three sides alternate round by round; medians of milliseconds per layer
call (the plan, once per step for all layers, is timed apart). Compile cost: a fresh process with an empty kvcore
cache folder times flex's first prefill and first decode call (cold), a second process with that folder the same
(cached: inductor's kernels and FX graphs on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 9, 3, 64, 2048


def setup(name: str, dtype: torch.dtype, options: dict | None = None):
    """Backend ``name``, a one-layer contiguous cache with one sequence, and its cache manager."""
    from kvcore.backends.contiguous import ContiguousKVCache
    from kvcore.interfaces.kv_cache import CacheSpec
    from kvcore.plugins.registry import get_registry
    from kvcore.scheduling.kv_manager import KVCacheManager

    spec = CacheSpec(1, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), 1, CONTEXT + 64)
    return get_registry().create(name, options), KVCacheManager(ContiguousKVCache(spec))


def step(backend, kv, query_len: int, dtype: torch.dtype, gen: torch.Generator):
    """``(plan seconds, forward seconds)`` of one call of ``query_len`` new tokens of sequence 0."""
    q = torch.randn(query_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(query_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    meta = kv.prepare([0], [query_len], HEAD_DIM**-0.5)
    start = time.perf_counter()
    plan = backend.plan(meta, kv.cache)
    planned = time.perf_counter()
    backend.forward(0, q, k, v, kv.cache, plan)
    return planned - start, time.perf_counter() - planned


def first_calls(dtype: torch.dtype) -> dict:
    """Seconds of flex's first prefill and first decode call in this process (the compile cost, or its load)."""
    backend, kv = setup("flex", dtype)
    gen = torch.Generator().manual_seed(0)
    kv.add_sequence(0)
    start = time.perf_counter()
    step(backend, kv, CONTEXT, dtype, gen)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    step(backend, kv, 1, dtype, gen)
    return {"prefill": prefill, "decode": time.perf_counter() - start}


def timings(names: list[str], dtype: torch.dtype, rounds: int) -> dict:
    """Median ms of ``forward`` (and of ``plan``) per backend, prefill and decode, alternating the backends."""
    sides = {n: setup(n, dtype) for n in names}
    gen = torch.Generator().manual_seed(0)
    samples = {(n, phase, part): [] for n in names for phase in ("prefill", "decode") for part in ("plan", "fwd")}
    for r in range(rounds + 1):  # round 0 warms up (flex compiles there)
        for n, (backend, kv) in sides.items():
            if r:
                kv.free_sequence(0)
            kv.add_sequence(0)
            for phase, query_len in (("prefill", CONTEXT), ("decode", 1)):
                plan_s, fwd_s = step(backend, kv, query_len, dtype, gen)
                if r:
                    samples[(n, phase, "plan")].append(plan_s * 1e3)
                    samples[(n, phase, "fwd")].append(fwd_s * 1e3)
    return {key: statistics.median(v) for key, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--first-calls", action="store_true", help="(internal) print this process's first-call seconds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.first_calls:
        print(json.dumps(first_calls(dtype)))
        return
    from kvcore.kernels.cpu import cpu_features

    print(f"{cpu_features().describe()}; {args.dtype}; load average "
          f"{os.getloadavg()[0]:.1f}; H={HEADS} H_kv={KV_HEADS} D={HEAD_DIM}; medians of {args.rounds} rounds\n")
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "KVCORE_CACHE_DIR": folder}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        cmd = [sys.executable, __file__, "--first-calls", "--dtype", args.dtype, "--threads", str(args.threads)]
        runs = [json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
                for _ in range(2)]
    print("| flex first call | prefill 2048 | decode at 2048 |\n|---|---:|---:|")
    for label, run in zip(("cold (empty cache folder)", "cached (second process)"), runs):
        print(f"| {label} | {run['prefill']:.1f} s | {run['decode']:.1f} s |")
    names = ["sdpa", "cpu_decode", "flex"]
    med = timings(names, dtype, args.rounds)
    print("\n| backend | prefill 2048: forward | plan | decode at 2048: forward | plan |\n|---|---:|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {med[(n, 'prefill', 'fwd')]:.2f} ms | {med[(n, 'prefill', 'plan')]:.2f} ms | "
              f"{med[(n, 'decode', 'fwd')]:.3f} ms | {med[(n, 'decode', 'plan')]:.3f} ms |")


if __name__ == "__main__":
    main()
