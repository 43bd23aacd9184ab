"""What a small op costs warm and right after a sweep over as many bytes as a decode step's weights.

    python benchmarks/micro/cold_ops.py            # 1 thread, this thread's CPU time, medians of 50
    python benchmarks/micro/cold_ops.py --sweep-mib 80 --reps 50

A batch-1 decode step streams its weights (~80 MiB for SmolLM2) through the caches, so the ops that follow find
their code and data evicted. Each op is timed with nothing before it ("warm") and right after writing a buffer of
``--sweep-mib`` MiB ("after the sweep"): the ATen ops around the LM head that cb741bd ran, the token table's
lookup of one kept row, and kvcore's operators that replace them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep-mib", type=int, default=80)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sweep = torch.empty(args.sweep_mib << 20, dtype=torch.uint8)
    out0 = torch.randn(1, 9, 64).bfloat16()  # layer 0's attention output
    logits = torch.randn(1, 49152).bfloat16()
    wide = logits.float()
    table = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=64)).model.embedding
    one = torch.tensor([1234])
    rows = table.blocks._table if table is not None else None
    cases = {
        "out0.sum()": lambda: out0.sum(),
        "logits.float()": lambda: logits.float(),
        "finite flag (2 sums, add, isfinite, bool)": lambda: bool((out0.sum() + wide.sum()).isfinite()),
        "blocked argmax (amax, argmax, index, argmax)": lambda: _blocked_argmax(wide),
    }
    ops = torch.ops.kvcore
    cases["kvcore::all_finite"] = lambda: ops.all_finite([out0, wide])
    cases["kvcore::argmax_rows"] = lambda: ops.argmax_rows(wide)
    if rows is not None:
        rows[one]
        cases["token table: one kept row (FileRows, NumPy)"] = lambda: rows[one]
        cases["kvcore::q8_0_kept_rows (one row, decoded)"] = lambda: ops.q8_0_kept_rows(*rows.kept, one, 576,
                                                                                      torch.bfloat16)
    print(f"1 thread, this thread's CPU time, medians of {args.reps} (us): warm / after a {args.sweep_mib} MiB sweep")
    for name, fn in cases.items():
        times = {}
        for swept in (False, True):
            xs = []
            for _ in range(args.reps):
                if swept:
                    sweep.add_(1)
                start = time.thread_time()
                fn()
                xs.append(time.thread_time() - start)
            times[swept] = statistics.median(xs) * 1e6
        print(f"  {name:48s} {times[False]:7.1f} / {times[True]:7.1f}")


def _blocked_argmax(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(1, -1, 256)
    best = blocks.amax(-1).argmax(-1)
    return best * 256 + blocks[torch.arange(1), best].argmax(-1)


if __name__ == "__main__":
    main()
