"""Aggregate tokens/s of 8 concurrent requests (64-token prompts, 128 new tokens each, prefill included) with
kvcore's default configuration, the shape of ``llama-batched-bench -npp 64 -ntg 128 -npl 8``:

    python benchmarks/studies/concurrent8.py MODEL [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, EngineConfig(max_num_seqs=8))
    prompts = [list(range(1000 + 64 * i, 1064 + 64 * i)) for i in range(8)]
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True))
    took = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    print(f"kvcore 8 concurrent: {tokens / took:.1f} tok/s aggregate (prefill included)")


if __name__ == "__main__":
    main()
