"""The decode attention kernel against an earlier version of itself, side by side in one process.

    python benchmarks/micro/decode_attention_kernel.py [--base a2e8171] [--threads 1 2] [--rows 1 5]

Both versions of ``kvcore/kernels/csrc/decode_attention.cpp`` (the one at git revision ``--base`` and the
working tree's) are built here as standalone libraries (benchmarks/micro/kernel_ab.py) and called the way the
``cpu_decode`` backend calls ``cached_decode_attention``: SmolLM2's shape (9 query heads on 3 KV heads, head size
64), R query tokens per sequence (1: a decode step, 5: a verification of 4 drafts), 30 layers cycled so that long
contexts read their rows from memory, not from a warm cache.
With one thread the time is the calling thread's CPU time (``time.thread_time``: robust on a shared machine);
with more, wall time. The sides alternate pass by pass; medians of microseconds per layer call.
"""

from __future__ import annotations

import argparse
import time

import torch
from kernel_ab import alternate, build

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import vector_isa

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64
SOURCE = "decode_attention.cpp"


def setup(dtype: torch.dtype, rows: int, context: int, batch: int) -> tuple:
    """One call's operands per layer: R new tokens after ``context - R`` cached keys in each of ``batch`` slots, and
    the caches of all layers."""
    g = torch.Generator().manual_seed(0)
    s_max = context + 16
    caches = [torch.randn(LAYERS, batch, KV_HEADS, s_max, HEAD_DIM, generator=g).to(dtype) for _ in range(2)]
    q = torch.randn(batch * rows, KV_HEADS * GROUP, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(batch * rows, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    slot, pos, head = (x.flatten() for x in torch.meshgrid(torch.arange(batch), torch.arange(context - rows, context),
                                                           torch.arange(KV_HEADS), indexing="ij"))
    token_rows = (slot * KV_HEADS + head) * s_max + pos  # token (slot, position), head: in order
    cache_rows = (torch.arange(LAYERS)[:, None] * batch * KV_HEADS * s_max + token_rows[None, :]).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return q, k, v, caches, cache_rows, seq_lens


def per_layer_us(op, operands: tuple, context: int, clock) -> float:
    q, k, v, (k_cache, v_cache), cache_rows, seq_lens = operands
    start = clock()
    for layer in range(LAYERS):
        op(q, k, v, k_cache, v_cache, cache_rows, seq_lens, layer, 0, context, HEAD_DIM**-0.5)
    return (clock() - start) / LAYERS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="a2e8171", help="git revision of the kernel to compare against")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--batch", type=int, default=1, help="sequences per call")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args()
    build(args.base, SOURCE, "kvcore_ab_base")
    build(None, SOURCE, "kvcore_ab_now")
    sides = {"base": torch.ops.kvcore_ab_base.cached_decode_attention,
             "now": torch.ops.kvcore_ab_now.cached_decode_attention}
    print(f"{cpu_features().describe()}; built for {vector_isa()}; base {args.base} vs working tree; "
          f"batch {args.batch}; {LAYERS} layers cycled; medians of {args.passes} alternating passes")
    print("| dtype | threads | R | context | base µs/layer | now µs/layer | speed-up | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for threads in args.threads:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            for rows in args.rows:
                for context in args.contexts:
                    operands = setup(dtype, rows, context, args.batch)
                    outs = [fn(*operands[:3], *operands[3], *operands[4:], 0, 0, context, HEAD_DIM**-0.5)
                            for fn in sides.values()]
                    diff = (outs[0].double() - outs[1].double()).abs().max().item()
                    a, b = alternate(sides, args.passes, per_layer_us, operands, context, clock)
                    print(f"| {dtype_name} | {threads} | {rows} | {context} | {a:.1f} | {b:.1f} | {a / b:.2f}× "
                          f"| {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
