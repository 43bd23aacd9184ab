"""The matmul kernels behind each weight format, on a full SmolLM2-135M-sized weight set.

Each configuration runs every projection of 30 layers (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) plus the 49152x576 LM head once, with distinct random weights (so nothing stays in cache: the
memory traffic of a real decode step), configurations interleaved pass by pass. Median of ``--passes``, ms.

    python benchmarks/micro/weight_kernels.py                     # rows 1, 8, 64; torch's default threads
    python benchmarks/micro/weight_kernels.py --rows 1 --threads 1
    python benchmarks/micro/weight_kernels.py --rows 2048 --threads 2 --passes 3 \
        --only "layers: bf16 oneDNN,layers: int4a8"                       # a 2048-token prefill's matmuls

Configurations: ``fp32 split GEMV`` (kvcore's float32 one-row path), ``fp32 oneDNN`` (its multi-row path),
``bf16 F.linear`` (plain), ``bf16 oneDNN`` (prepacked: kvcore's bfloat16 path on CPUs without AVX512_BF16),
``bf16 kvcore`` (kvcore's bf16_linear kernel, where the CPU has AVX512_BF16), ``int4`` (groups of 32,
bfloat16 activations), ``int8`` (per-channel, bfloat16 activations), ``int4a8`` (the int4 weights with int8
activations, where the CPU has AVX512-VNNI or AVX2); ``head:`` rows time the LM head alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.cpu_kernels import bf16_linear_ready, int4a8_reasons
from kvcore.kernels.int8 import Int8Linear
from kvcore.kernels.linear import Bf16Linear, linear, pack_bf16
from kvcore.kernels.quant import Int4A8Linear, Int4Groups, Int4Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated configuration names to time (default: all), "
                    "e.g. 'layers: bf16 oneDNN,layers: int4a8' for prefill-sized --rows 2048")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_features().describe())
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=gen) * 0.05 for _ in range(30) for s in SHAPES]
    head = torch.randn(*HEAD, generator=gen) * 0.05
    threads = torch.get_num_threads()
    kernels: dict[str, list] = {}
    onednn_bf16 = _onednn_packs_bf16()
    for label, ws in (("layers", weights), ("head", [head])):
        bf16 = [w.bfloat16() for w in ws]
        kernels[f"{label}: fp32 split GEMV"] = [("gemv", w.t().contiguous().t()) for w in ws]
        kernels[f"{label}: fp32 oneDNN"] = [("packed", torch.ops.mkldnn._reorder_linear_weight(w, 8)) for w in ws]
        kernels[f"{label}: bf16 F.linear"] = [("plain", w) for w in bf16]
        if onednn_bf16:
            kernels[f"{label}: bf16 oneDNN"] = [("packed", torch.ops.mkldnn._reorder_linear_weight(w, 8)) for w in bf16]
        if bf16_linear_ready():
            kernels[f"{label}: bf16 kvcore"] = [("call", Bf16Linear(w, pack_bf16(w))) for w in bf16]
        kernels[f"{label}: int4 g32"] = [("call", Int4Linear(Int4Groups.from_float(w, 32))) for w in ws]
        kernels[f"{label}: int8"] = [("call", Int8Linear(w)) for w in ws]
        if not int4a8_reasons():
            kernels[f"{label}: int4a8"] = [("call", Int4A8Linear(Int4Groups.from_float(w, 32))) for w in ws]

    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = [name for name in wanted if name not in kernels]
        if unknown:
            raise SystemExit(f"--only: unknown {unknown}; choose from {list(kernels)}")
        kernels = {name: kernels[name] for name in wanted}

    def run(entries, rows):
        for kind, w in entries:
            k = w.shape[1]
            x = xs[(k, torch.float32 if kind == "gemv" or (kind == "packed" and w.dtype == torch.float32)
                    else torch.bfloat16)]
            if kind == "gemv":
                linear(x, w, None, threads if rows == 1 else 1)
            elif kind == "packed":
                linear(x, w, w, 1)
            elif kind == "plain":
                F.linear(x, w)
            else:
                w(x)

    for rows in (int(r) for r in args.rows.split(",")):
        xs = {(k, dt): torch.randn(rows, k).to(dt) for k in (576, 1536) for dt in (torch.float32, torch.bfloat16)}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for entries in kernels.values():  # warm-up
            run(entries, rows)
        for _ in range(args.passes):
            for name, entries in kernels.items():
                start = time.perf_counter()
                run(entries, rows)
                times[name].append(time.perf_counter() - start)
        print(f"\nrows {rows}, {threads} threads: median ms (min)")
        for name, ts in times.items():
            print(f"  {name:24s} {statistics.median(ts) * 1e3:8.2f}  ({min(ts) * 1e3:.2f})")


def _onednn_packs_bf16() -> bool:
    """Whether oneDNN prepacks bfloat16 weights here (it needs AVX-512 or AVX-NE-CONVERT; AVX2 alone is refused)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 8)
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    main()
