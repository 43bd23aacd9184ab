"""Time to first token of one long prompt, paged vs sdpa backend, alternating runs (SmolLM2, fp32).

    python benchmarks/studies/prefill_ttft.py --tokens 2048 --reps 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {b: Engine.from_pretrained("smollm2", EngineConfig(backend=b, dtype="float32",
                                                                 max_model_len=args.tokens + 16, max_num_seqs=1))
               for b in ("sdpa", "paged")}
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompt = [(7 * i) % 40000 + 100 for i in range(args.tokens)]
    for engine in engines.values():  # warm-up: oneDNN weight packs, page faults
        engine.generate([prompt[:64]], params)
    times: dict[str, list[float]] = {b: [] for b in engines}
    for rep in range(args.reps):
        for name in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            engines[name].generate([prompt], params)
            times[name].append(time.perf_counter() - start)
    for name, runs in times.items():
        print(f"{name}: TTFT runs {[round(t, 3) for t in runs]} s, median {statistics.median(runs):.3f} s")
    ratios = [p / s for p, s in zip(times["paged"], times["sdpa"])]
    print(f"paged / sdpa, median of paired ratios: {statistics.median(ratios):.3f} "
          f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
