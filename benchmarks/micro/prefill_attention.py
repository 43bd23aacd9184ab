"""Prefill attention alone: kvcore's bfloat16 C++ kernel (``cpu_decode``) against torch SDPA (``sdpa``'s call).

    python benchmarks/micro/prefill_attention.py [--threads 2] [--rounds 5]

SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64) in bfloat16: fresh prompts of several lengths and a
prefill continuing a cache (chunked prefill: the causal mask aligned bottom-right). Both sides get the same
strided views of one cache, as the backends pass them, and alternate; medians of milliseconds per layer call,
the speed in GFLOPS (the causal half of ``4 T L H D``), and the larger error of each against float64.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcore.interfaces.attention import causal_mask
from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import load_kernels, vector_isa

GRID = ((128, 0), (512, 0), (2048, 0), (256, 1792))  # (new query rows, keys already in the cache)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    if not torch.ops.kvcore.built_with("avx512_bf16"):
        raise SystemExit("kvcore's kernels were built without AVX512_BF16: no bfloat16 prefill kernel on this CPU")
    print(f"{cpu_features().describe()}; kernels built for {vector_isa()} + AVX512_BF16; bfloat16; "
          f"medians of {args.rounds} alternating rounds")
    print("| query rows | cached keys | torch SDPA | kvcore kernel | speed-up | kernel GFLOPS | max err SDPA / kernel "
          "vs float64 |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for rows, context in GRID:
        seq_len = context + rows
        cache = torch.randn(2, KV_HEADS, seq_len + 64, HEAD_DIM, generator=g).bfloat16()
        k, v = cache[0, :, :seq_len], cache[1, :, :seq_len]
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).bfloat16()
        mask = causal_mask(context, rows, q.device) if context else None

        def sdpa(q=q, k=k, v=v, mask=mask, context=context):
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                 is_causal=not context, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)

        def kernel(q=q, k=k, v=v, context=context):
            return torch.ops.kvcore.prefill_attention(q, k, v, context, scale)

        sides = {"sdpa": sdpa, "kernel": kernel}
        samples = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                fn()
                start = time.perf_counter()
                for _ in range(3):
                    fn()
                samples[name].append((time.perf_counter() - start) / 3 * 1e3)
        ref = sdpa(q.double(), k.double(), v.double())  # the same call in float64
        errs = [(fn().double() - ref).abs().max().item() for fn in sides.values()]
        a, b = statistics.median(samples["sdpa"]), statistics.median(samples["kernel"])
        flops = 4 * HEADS * HEAD_DIM * rows * (context + (rows + 1) / 2)  # each row sees context + its own keys
        print(f"| {rows} | {context} | {a:.2f} ms | {b:.2f} ms | {a / b:.2f}× | {flops / b / 1e6:.0f} | "
              f"{errs[0]:.1e} / {errs[1]:.1e} |")


if __name__ == "__main__":
    main()
