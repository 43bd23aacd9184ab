"""Median wall time of a batch-1 decode step (SmolLM2, fp32, 64-token prompt), for before/after comparisons.

    python benchmarks/studies/step_time.py --backend sdpa --steps 60
    PYTHONPATH=/path/to/older/kvcore python benchmarks/studies/step_time.py   # run from outside the repository
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2", EngineConfig(backend=args.backend, dtype="float32", max_model_len=256))
    engine.add_request(list(range(100, 164)), SamplingParams(max_new_tokens=args.steps + 8, ignore_eos=True))
    for _ in range(4):  # prefill and warm-up steps
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{args.backend}: decode step median {statistics.median(times) * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms ({args.steps} steps, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
