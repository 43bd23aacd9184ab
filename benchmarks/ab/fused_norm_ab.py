"""Decode step time of the default engine with one of kvcore's fused paths on and off, alternating in one process
(the model's switch toggled between rounds), so that load hits both alike:

* ``--switch fused_norm`` (the default): the fused residual add + RMSNorm against the eager ops (the fused layers
  off in both);
* ``--switch fused_layers``: each layer as kvcore's two fused operators against the eager layer (with the fused norm);
* ``--switch cached_decode``: the ``cpu_decode`` backend's attention as one call per layer (cache write and kernel)
  against sdpa's ops around the same kernel (the fused layers on in both).

    python benchmarks/ab/fused_norm_ab.py [--switch fused_layers|cached_decode] [--threads 1] [--rounds 8] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=("fused_norm", "fused_layers", "cached_decode"), default="fused_norm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=1, help="concurrent sequences (rows per decode step)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=1024, max_num_seqs=args.batch))
    model, backend = engine.model, engine.decode_backend
    holder = backend if args.switch == "cached_decode" else model  # what the switch is an attribute of
    if not getattr(holder, args.switch, False):
        raise SystemExit(f"the default here ({model.weight_format} weights, backend {backend.name}) does not use "
                         f"{args.switch}")
    if args.switch == "fused_norm":
        model.fused_layers = False
    for b in range(args.batch):
        engine.add_request(list(range(100 + b, 164 + b)), SamplingParams(max_new_tokens=1024 - 64, ignore_eos=True))
    for _ in range(4):  # prefill and first decode steps
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for fused in (True, False):
            setattr(holder, args.switch, fused)
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[fused].append((time.perf_counter() - start) / args.steps * 1e3)
    for fused, ms in times.items():
        print(f"{args.switch} {'on' if fused else 'off'}: median {statistics.median(ms):.2f} ms per decode step; "
              f"per round {' '.join(f'{t:.1f}' for t in ms)}")


if __name__ == "__main__":
    main()
