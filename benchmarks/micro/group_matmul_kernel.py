"""A group-quantized matmul kernel against an earlier version of itself, side by side.

    python benchmarks/micro/group_matmul_kernel.py [--kernel int4a8] [--base ce6adf8] [--threads 1 2] [--rows 1 2 4 8]

``--kernel int4a8``: ``kvcore/kernels/csrc/int4_linear.cpp`` (the default layer weights' kernel: 4-bit codes in
groups of 32); ``int8-g32`` / ``int8-g16``: ``int8_group_linear.cpp`` (one byte per code: GGUF Q5 / Q6_K / Q8_0
weights, groups of 32 or 16). Both versions of the file and the headers it includes (group_matmul.h,
quantize_rows.h, ...), the ones at git revision ``--base`` and the working tree's, are built here as standalone
libraries (kernel_ab.py) and run on the projections of SmolLM2-135M's 30 layers (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536), distinct random weights per layer (a decode step's memory traffic), bfloat16
activations of R rows (1: a decode step, 4-9: a verification of drafts, 8-16: concurrent requests). With one thread
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
from kvcore.kernels.group_quant import GroupCodes, pack_int8_groups
from kvcore.kernels.quant import Int4Groups, pack_int4a8

LAYERS, SHAPES = 30, ((960, 576), (576, 576), (3072, 576), (576, 1536))
#: kernel -> (source file, operator, bits per code, group size)
KERNELS = {"int4a8": ("int4_linear.cpp", "int4_linear", 4, 32),
           "int8-g32": ("int8_group_linear.cpp", "int8_group_linear", 8, 32),
           "int8-g16": ("int8_group_linear.cpp", "int8_group_linear", 8, 16)}


def weights(bits: int, group: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(K, packed, dm)`` of every layer's projections, random codes and scales."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            if bits == 4:
                out.append((k, *pack_int4a8(Int4Groups.from_float(torch.randn(n, k, generator=g)))))
            else:
                q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
                d, m = torch.rand(n, k // group, generator=g) / 256, torch.randn(n, k // group, generator=g) / 8
                out.append((k, *pack_int8_groups(GroupCodes(q, d, m, bits))))
    return out


def layers_ms(op, xs: dict[int, torch.Tensor], packed: list, clock) -> float:
    start = clock()
    for k, codes, dm in packed:
        op(xs[k], codes, dm)
    return (clock() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="int4a8", choices=KERNELS)
    ap.add_argument("--base", default="ce6adf8", help="git revision of the kernel to compare against")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    ap.add_argument("--passes", type=int, default=12)
    args = ap.parse_args()
    source, operator, bits, group = KERNELS[args.kernel]
    build(args.base, source, "kvcore_ab_base")
    build(None, source, "kvcore_ab_now")
    sides = {"base": getattr(torch.ops.kvcore_ab_base, operator), "now": getattr(torch.ops.kvcore_ab_now, operator)}
    packed = weights(bits, group)
    print(f"{cpu_features().describe()}; built for {vector_isa()}; {args.kernel}; base {args.base} vs working tree; "
          f"{LAYERS} layers' projections; medians of {args.passes} alternating passes")
    print("| threads | R | base ms | now ms | speed-up | same bits |")
    print("|---:|---:|---:|---:|---:|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for rows in args.rows:
            g = torch.Generator().manual_seed(rows)
            xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
            same = all(torch.equal(sides["base"](xs[k], c, d), sides["now"](xs[k], c, d))
                       for k, c, d in packed[:len(SHAPES)])
            a, b = alternate(sides, args.passes, layers_ms, xs, packed, clock)
            print(f"| {threads} | {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}× | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
