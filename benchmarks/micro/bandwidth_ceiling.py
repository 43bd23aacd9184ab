"""The memory-bandwidth ceiling of batch-1 decode: how fast any engine can go when every token streams its weights.

At batch 1 a decode step reads every layer matmul weight and the LM head once, so a step takes at least
``bytes per token / read bandwidth``. This measures both sides of that bound on this machine:

* bytes per token: kvcore's default configuration (what its packed layer matmuls and LM head hold, as built by
  the engine) and llama.cpp's (every tensor of the GGUF file but the token embedding, plus the embedding table
  itself when the file ties it to the output, as llama.cpp then multiplies by it);
* the read bandwidth of this machine on ``--threads`` threads, for buffers of exactly those sizes read again
  and again (as decode re-reads its weights), alternating with ``llama-bench tg128`` on the same file (native
  llama.cpp, found or built like ``kvcore bench --llamacpp-native``) so the measured speed and the bound come
  from the same minutes.

It prints the ceiling of each side in tokens/s, llama.cpp's measured fraction of its own ceiling and the largest
kvcore / llama.cpp ratio the bandwidth allows. Each repetition also times kvcore's step matmuls alone (every layer
matmul and the LM head, one row, back to back from Python with nothing between them: the weight traffic of a step
without its attention, norms and host work), so the table shows how close the kernels come to the bound.

``--sweep`` first reads buffers from 16 MiB to 256 MiB: where the read bandwidth falls is where the last-level
cache this process gets ends, which says whether a step's bytes are re-read from that cache or from memory::

    python benchmarks/micro/bandwidth_ceiling.py --threads 2 --reps 3 [--no-llamacpp] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvcore.engine.core import Engine, EngineConfig
from kvcore.kernels.cpu import cpu_features
from kvcore.loaders import DEFAULT_MODEL
from kvcore.loaders.model_cache import gguf_source
from kvcore_bench.floor import kvcore_bytes_per_token, llamacpp_bytes_per_token, read_bandwidth
from kvcore_bench.native_llamacpp import build_tools, llama_bench

MIB = 2**20


SWEEP_MIB = (16, 32, 48, 64, 72, 80, 96, 128, 256)


def step_matmuls(engine: Engine):
    """A function running ``engine``'s step matmuls once on one row (the layers in order, then the LM head)."""
    model = engine.model
    mats = model.matmuls(1)
    calls = [(lin, torch.randn(1, lin.shape[1], dtype=lin.dtype)) for layer in
             zip(*(mats[name] for name in ("qkv", "o", "gate_up", "down"))) for lin in layer]
    head = engine.lm_head.int4 if engine.lm_head is not None else mats["lm_head"][0]
    calls.append((head, torch.randn(1, head.shape[1], dtype=head.dtype)))

    def run() -> None:
        for lin, x in calls:
            lin(x)
    return run


def matmul_seconds(run, threads: int, seconds: float = 2.0) -> float:
    """Median seconds of ``run()`` on ``threads`` threads, back to back."""
    torch.set_num_threads(threads)
    run()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-llamacpp", action="store_true", help="only the bound, no llama-bench run")
    ap.add_argument("--sweep", action="store_true", help="first, the read bandwidth of buffers of 16-256 MiB")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    gguf = gguf_source(DEFAULT_MODEL)
    engine = Engine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_model_len=256, max_num_seqs=1))
    ours, theirs = kvcore_bytes_per_token(engine), llamacpp_bytes_per_token(gguf)
    run_matmuls = step_matmuls(engine)
    ours_total, theirs_total = sum(ours.values()), sum(theirs.values())
    sweep = {mib: read_bandwidth(mib * MIB, args.threads) for mib in SWEEP_MIB} if args.sweep else {}
    bin_dir = None if args.no_llamacpp else build_tools()
    rows = []
    for rep in range(args.reps):
        row = {"rep": rep + 1, "load": os.getloadavg()}
        row["matmuls_s"] = matmul_seconds(run_matmuls, args.threads)
        row["bw_kvcore"] = read_bandwidth(ours_total, args.threads)
        row["bw_llamacpp"] = read_bandwidth(theirs_total, args.threads)
        if bin_dir is not None:
            row["tg128"] = float(llama_bench(bin_dir, gguf, args.threads)["avg_ts"])
        rows.append(row)

    print(f"CPU: {cpu_features().describe()}; GGUF {gguf.name}")
    print("bytes per token (MiB): kvcore default " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in ours.items())
          + f" = {ours_total / MIB:.1f}; llama.cpp " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in theirs.items())
          + f" = {theirs_total / MIB:.1f}\n")
    if sweep:
        print("| buffer (MiB) | " + " | ".join(str(mib) for mib in sweep) + " |")
        print("|---" * (len(sweep) + 1) + "|")
        print("| read GB/s | " + " | ".join(f"{bw / 1e9:.1f}" for bw in sweep.values()) + " |\n")
    head = ("| rep | load avg | read GB/s (kvcore's bytes) | kvcore ceiling tok/s | step matmuls alone ms (GB/s) "
            "| read GB/s (llama.cpp's) | llama.cpp ceiling")
    print(head + (" | llama.cpp tg128 | tg128 / its ceiling | most kvcore / tg128 |" if bin_dir else " |"))
    print("|---" * (10 if bin_dir else 7) + "|")
    for r in rows:
        ours_ceiling, theirs_ceiling = r["bw_kvcore"] / ours_total, r["bw_llamacpp"] / theirs_total
        r.update(kvcore_ceiling=ours_ceiling, llamacpp_ceiling=theirs_ceiling)
        line = (f"| {r['rep']} | {' '.join(f'{x:.2f}' for x in r['load'])} | {r['bw_kvcore'] / 1e9:.1f} | "
                f"{ours_ceiling:.0f} | {r['matmuls_s'] * 1e3:.2f} ({ours_total / r['matmuls_s'] / 1e9:.1f}) | "
                f"{r['bw_llamacpp'] / 1e9:.1f} | {theirs_ceiling:.0f}")
        if bin_dir:
            line += f" | {r['tg128']:.1f} | {r['tg128'] / theirs_ceiling:.2f} | {ours_ceiling / r['tg128']:.2f}x"
        print(line + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_features().as_dict(), "threads": args.threads, "kvcore_bytes": ours,
                       "llamacpp_bytes": theirs, "sweep_bytes_per_s": {str(k): v for k, v in sweep.items()},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
