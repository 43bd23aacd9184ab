"""Batch-1 decode step time of several engine configurations side by side (SmolLM2; backend sdpa unless a
configuration names another), alternating in one process so that the machine's load hits them alike; the first
configuration is the baseline.

    python benchmarks/studies/decode_configs.py '{"dtype": "float32"}' \
        '{"dtype": "bfloat16", "weights": "float"}' '{"dtype": "bfloat16", "weights": "float", "compile": true}'

Each argument is a JSON object of EngineConfig fields. Every engine decodes one request (64-token prompt);
after 4 warm-up steps (prefill, first decodes, compiles) the engines take turns for ``--rounds`` blocks of
``--steps`` steps; the median step time of each is reported with its speed relative to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.kernels.cpu import cpu_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="JSON objects of EngineConfig fields")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [json.loads(c) for c in args.configs]
    engines, warmups = [], []
    for config in configs:
        engine = Engine.from_pretrained("smollm2", EngineConfig(**{"backend": "sdpa", "max_model_len": 1024, **config}))
        engine.add_request(list(range(100, 164)), SamplingParams(
            max_new_tokens=args.rounds * args.steps + 8, ignore_eos=True))
        start = time.perf_counter()
        for _ in range(4):
            engine.step()
        warmups.append(time.perf_counter() - start)
        engines.append(engine)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(args.rounds):
        for engine, samples in zip(engines, times):
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
    print(f"{cpu_features().describe()}; {args.rounds} rounds x {args.steps} steps, batch 1, 64-token prompt")
    print("| configuration | warm-up (4 steps) | median step | tok/s | speed vs the first |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(times[0])
    for config, warmup, samples in zip(configs, warmups, times):
        step = statistics.median(samples)
        print(f"| `{json.dumps(config)}` | {warmup:.1f} s | {step * 1e3:.2f} ms | {1 / step:.1f} "
              f"| {base / step:.2f}x |")


if __name__ == "__main__":
    main()
