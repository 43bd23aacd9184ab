"""Per-call time of the decoder's RMSNorm at decode shape: the spelled-out ops vs the fused kernel.

    python benchmarks/micro/small_ops.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def spelled_out(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kvcore's RMSNorm before it used F.rms_norm (Hugging Face's formula, weight multiplied in place)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).mul_(weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, w = torch.randn(args.rows, args.width), torch.randn(args.width)
    cases = {
        "spelled out": lambda: spelled_out(x, w, 1e-5),
        "F.rms_norm": lambda: F.rms_norm(x, (args.width,), w, 1e-5),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for _ in range(args.reps):  # alternate the two so that load drifts hit both
            for name, fn in cases.items():
                for _ in range(100):
                    fn()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    for name, runs in times.items():
        print(f"{name}: {statistics.median(runs):.1f} us per call (median of {args.reps}; [{args.rows}, {args.width}], "
              f"{args.threads} thread(s))")


if __name__ == "__main__":
    main()
