"""The int4a8 matmul (the default layer weights' kernel) against an earlier version of itself, side by side.

    python benchmarks/int4a8_kernel.py [--base ce6adf8] [--threads 1 2] [--rows 1 2 4 5 8 16]

Both versions of ``kvcore/kernels/csrc/int4_linear.cpp`` and the headers it includes (int4a8.h, group_matmul.h,
quantize_rows.h), the ones at git revision ``--base`` and the working tree's, are built here as standalone libraries
(benchmarks/kernel_ab.py) and run on the projections of SmolLM2-135M's 30 layers (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), distinct random weights per layer (about 64 MiB: a decode step's memory traffic), bfloat16
activations of R rows (1: a decode step, 4-5: a verification of drafts, 8-16: concurrent requests). With one thread
the time is the calling thread's CPU time (``time.thread_time``: robust on a shared machine); with more, wall time.
The sides alternate pass by pass; medians of milliseconds per 30 layers, and whether both sides' outputs are the
same bits.
"""

from __future__ import annotations

import argparse
import time

import torch
from kernel_ab import alternate, build

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import vector_isa
from kvcore.kernels.quant import Int4Groups, pack_int4a8

LAYERS, SHAPES = 30, ((960, 576), (576, 576), (3072, 576), (576, 1536))
SOURCE = "int4_linear.cpp"


def weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [pack_int4a8(Int4Groups.from_float(torch.randn(n, k, generator=g)))
            for _ in range(LAYERS) for n, k in SHAPES]


def layers_ms(op, xs: dict[int, torch.Tensor], packed: list, clock) -> float:
    start = clock()
    for codes, dm in packed:
        op(xs[codes.shape[1] * 32], codes, dm)
    return (clock() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="ce6adf8", help="git revision of the kernel to compare against")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    ap.add_argument("--passes", type=int, default=12)
    args = ap.parse_args()
    build(args.base, SOURCE, "kvcore_ab_base")
    build(None, SOURCE, "kvcore_ab_now")
    sides = {"base": torch.ops.kvcore_ab_base.int4_linear, "now": torch.ops.kvcore_ab_now.int4_linear}
    packed = weights()
    print(f"{cpu_features().describe()}; built for {vector_isa()}; base {args.base} vs working tree; "
          f"{LAYERS} layers' projections; medians of {args.passes} alternating passes")
    print("| threads | R | base ms | now ms | speed-up | same bits |")
    print("|---:|---:|---:|---:|---:|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for rows in args.rows:
            g = torch.Generator().manual_seed(rows)
            xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
            same = all(torch.equal(sides["base"](xs[c.shape[1] * 32], c, d), sides["now"](xs[c.shape[1] * 32], c, d))
                       for c, d in packed[:len(SHAPES)])
            a, b = alternate(sides, args.passes, layers_ms, xs, packed, clock)
            print(f"| {threads} | {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}× | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
