"""Decode step time of the default engine with kvcore's fused residual add + RMSNorm and with the eager ops,
alternating in one process (the model's ``fused_norm`` toggled between rounds), so that load hits both alike.

    python benchmarks/fused_norm_ab.py [--threads 1] [--rounds 8] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=1024))
    model = engine.model
    if not model.fused_norm:
        raise SystemExit(f"the default here runs {model.weight_format} weights, which do not use the fused norm")
    engine.add_request(list(range(100, 164)), SamplingParams(max_new_tokens=1024 - 64, ignore_eos=True))
    for _ in range(4):  # prefill and first decode steps
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for fused in (True, False):
            model.fused_norm = fused
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[fused].append((time.perf_counter() - start) / args.steps * 1e3)
    for fused, ms in times.items():
        print(f"{'fused' if fused else 'eager ops'}: median {statistics.median(ms):.2f} ms per decode step; "
              f"per round {' '.join(f'{t:.1f}' for t in ms)}")


if __name__ == "__main__":
    main()
