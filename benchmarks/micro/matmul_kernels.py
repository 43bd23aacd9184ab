"""The GEMM kernel choices behind kvcore.model.decoder, measured on a full SmolLM2-135M-sized weight set.

Each configuration runs every projection of 30 layers (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) plus the 49152x576 LM head once, with distinct random weights (540 MB in float32, so
nothing stays in cache: the same memory traffic as a real decode step). Median of 5 passes, ms.

    python benchmarks/micro/matmul_kernels.py                 # float32, rows 1, 8, 512
    python benchmarks/micro/matmul_kernels.py --rows 1,2,8,16 --threads 1
    python benchmarks/micro/matmul_kernels.py --dtype bfloat16

Configurations (float32):
  row      F.linear on row-major [out, in] weights (what transformers runs)
  col      F.linear on column-major weights (kvcore's parameter layout on CPU)
  col_bmm  one-row only: kvcore's split GEMV, bmm over `threads` slices of the input dim, summed
  onednn   oneDNN linear on weights prepacked for ~8-row inputs (kvcore's multi-row path)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,512")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    weights = [[torch.randn(*s).to(dtype) for s in SHAPES] for _ in range(args.layers)]
    weights.append([torch.randn(49152, 576).to(dtype)])
    flat = [w for ws in weights for w in ws]
    col = [w.t().contiguous().t() for w in flat]
    packed = None
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in flat]
    megabytes = sum(w.numel() for w in flat) * flat[0].element_size() / 1e6
    print(f"{args.dtype}, {threads} threads, {megabytes:.0f} MB of weights")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        configs = {
            "row": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in flat],
            "col": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in col],
        }
        if rows == 1 and threads > 1 and dtype == torch.float32:
            def split(w, xs=xs):
                n, k = w.shape
                return torch.bmm(xs[k].view(threads, 1, k // threads), w.t().view(threads, k // threads, n)).sum(0)

            configs["col_bmm"] = lambda: [split(w) for w in col]
        if packed is not None:
            def onednn(xs=xs, lp=torch.ops.mkldnn._linear_pointwise):
                return [lp(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(flat, packed)]

            configs["onednn"] = onednn
        times: dict[str, list[float]] = {k: [] for k in configs}
        with torch.inference_mode():
            for f in configs.values():
                f()
            for _ in range(5 if rows < 100 else 2):
                for name, f in configs.items():
                    t = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t)
        print(f"rows {rows:5d}: " + "  ".join(f"{k} {statistics.median(v) * 1e3:7.1f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
