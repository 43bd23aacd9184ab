"""One layer's attention of a verification row ``[last, d1..dK]`` (R = K + 1 query tokens after a cached context),
SmolLM2's shape (3 KV heads of 3 query heads, head size 64): ``cached_decode_attention`` with R tokens (the rows'
K/V written, each K/V block read once for all rows) against the one-row kernel run once per row over the same
cache view (``decode_attention`` on a stride-0 batch: what cpu_decode did before).

    .venv/bin/python benchmarks/micro/verify_attention.py [--context 600] [--threads 1]

Reported: median process CPU microseconds per call, the two alternating in rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore.kernels.cpu_kernels import load_kernels

KV_HEADS, GROUP, HEAD_DIM, S_MAX = 3, 3, 64, 2048


def cpu_us(fn, calls: int = 200) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def compare(dtype: torch.dtype, rows: int, ctx: int, rounds: int) -> tuple[float, float]:
    """Median CPU us per call: the one-row kernel per row, and the one call for all rows."""
    ops = torch.ops.kvcore
    caches = [torch.randn(1, 1, KV_HEADS, S_MAX, HEAD_DIM).to(dtype) for _ in range(2)]
    q = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    cache_rows = (torch.arange(KV_HEADS) * S_MAX + torch.arange(ctx, ctx + rows)[:, None]).flatten()[None]
    seq_len = torch.tensor([ctx + rows], dtype=torch.int32)
    qs = q.reshape(rows, KV_HEADS, GROUP, HEAD_DIM)
    ks, vs = (c[0, 0, :, : ctx + rows].unsqueeze(0).expand(rows, -1, -1, -1) for c in caches)
    lens = torch.arange(ctx + 1, ctx + rows + 1, dtype=torch.int32)

    def one_call():
        ops.cached_decode_attention(q, k, v, caches[0], caches[1], cache_rows, seq_len, 0, 0, ctx + rows, 0.125)

    def per_row():
        ops.decode_attention(qs, ks, vs, lens, 0.125)

    times = {per_row: [], one_call: []}
    for r in range(rounds):
        for fn in (per_row, one_call) if r % 2 == 0 else (one_call, per_row):
            cpu_us(fn, 20)
            times[fn].append(cpu_us(fn))
    return statistics.median(times[per_row]), statistics.median(times[one_call])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    print(f"context {args.context}, {args.threads} thread(s)")
    print("| dtype | rows R | per-row kernel us | one call us | × |\n|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 2, 5, 9, 16):
            old, new = compare(dtype, rows, args.context, args.rounds)
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {old:.0f} | {new:.0f} | {old / new:.2f} |")


if __name__ == "__main__":
    main()
