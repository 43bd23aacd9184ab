"""One layer's attention for a few query rows after a cached context (a speculative verification row):
the prefill kernel against the decode kernel with one kernel row per query token (what ``cpu_decode`` runs).

    .venv/bin/python benchmarks/verify_attention.py [--context 1150] [--threads 1]

SmolLM2's shapes (9 query heads, 3 KV heads, head size 64), bfloat16; median CPU time of 200 calls.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from kvcore.kernels.cpu_kernels import load_kernels


def cpu_us(fn, reps: int = 200) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1150)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    load_kernels()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim, ctx = 9, 3, 64, args.context
    k = torch.randn(kv_heads, ctx + 16, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for rows in (1, 3, 5, 8):
        q = torch.randn(rows, heads, head_dim, dtype=torch.bfloat16)
        qs = q.reshape(rows, kv_heads, heads // kv_heads, head_dim).contiguous()
        lens = torch.arange(ctx + 1, ctx + rows + 1, dtype=torch.int32)
        ks, vs = k[:, : ctx + rows].expand(rows, -1, -1, -1), v[:, : ctx + rows].expand(rows, -1, -1, -1)
        kc, vc = k[:, : ctx + rows], v[:, : ctx + rows]
        prefill = cpu_us(functools.partial(torch.ops.kvcore.prefill_attention, q, kc, vc, ctx, head_dim**-0.5))
        decode = cpu_us(functools.partial(torch.ops.kvcore.decode_attention, qs, ks, vs, lens, head_dim**-0.5, 0, 0.0))
        print(f"{rows} query rows: prefill kernel {prefill:6.0f} us, decode kernel per row {decode:6.0f} us")


if __name__ == "__main__":
    main()
