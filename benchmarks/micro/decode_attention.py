"""Decode-step attention alone: kvcore's C++ kernel (``cpu_decode``) against torch SDPA (``sdpa``'s call).

    python benchmarks/micro/decode_attention.py [--dtype bfloat16] [--threads 2]

SmolLM2's shape (3 KV heads, 3 query heads each, head_dim 64) over a grid of batch sizes and context lengths.
Like a real decode step, each call reads another layer's cache: 30 layers of K/V are cycled, so at long
contexts the rows come from memory, not from a warm cache. Both sides get the same strided views of the same
caches (SDPA with the ragged-batch key-padding mask ``sdpa`` passes, the kernel with each row's length) and
alternate in blocks; medians of microseconds per layer call, and the larger error of each against float64.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import load_kernels, vector_isa

GRID = ((1, 128), (1, 2048), (8, 120), (8, 512), (8, 2048))
LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_features().describe()}; kernel built for {vector_isa()}; {args.dtype}; "
          f"{LAYERS} layers cycled; medians of {args.rounds} alternating rounds")
    print("| batch | context | torch SDPA | kvcore kernel | speed-up | max err SDPA / kernel vs float64 |")
    print("|---:|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for batch, context in GRID:
        caches = [(torch.randn(batch, KV_HEADS, context + 64, HEAD_DIM, generator=g).to(dtype),
                   torch.randn(batch, KV_HEADS, context + 64, HEAD_DIM, generator=g).to(dtype)) for _ in range(LAYERS)]
        views = [(k[:, :, :context], v[:, :, :context]) for k, v in caches]
        q = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, generator=g).to(dtype)
        lens = torch.tensor([context - 7 * i for i in range(batch)], dtype=torch.int32)  # ragged as in serving
        valid = torch.arange(context)[None, :] < lens[:, None].long()
        mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf")).view(batch, 1, 1, context)

        def sdpa(k, v, q=q, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

        def kernel(k, v, q=q, lens=lens):
            return torch.ops.kvcore.decode_attention(q, k, v, lens, scale)

        sides = {"sdpa": sdpa, "kernel": kernel}
        samples = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                for k, v in views:  # warm the code, not the cache: every layer's rows are read once per pass
                    fn(k, v)
                start = time.perf_counter()
                for _ in range(4):
                    for k, v in views:
                        fn(k, v)
                samples[name].append((time.perf_counter() - start) / (4 * LAYERS) * 1e6)
        k, v = views[0]
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=scale)
        errs = [(fn(k, v).double() - ref).abs().max().item() for fn in sides.values()]
        a, b = statistics.median(samples["sdpa"]), statistics.median(samples["kernel"])
        print(f"| {batch} | {context} | {a:.1f} µs | {b:.1f} µs | {a / b:.2f}× | {errs[0]:.1e} / {errs[1]:.1e} |")


if __name__ == "__main__":
    main()
