"""ATen operator calls made by one decode step (SmolLM2, fp32, batch 1): a count that, unlike a time, does
not move with the machine's load.

    python benchmarks/studies/count_ops.py
    python benchmarks/studies/count_ops.py --defaults   # the engine's default configuration instead of fp32 sdpa
    PYTHONPATH=/path/to/older/kvcore python benchmarks/studies/count_ops.py   # run from outside the repository

"Top-level" counts the operators Python dispatches (each pays the interpreter and dispatcher overhead);
"all" adds the ones those operators call from C++.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--defaults", action="store_true", help="the engine's default configuration")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(max_model_len=256) if args.defaults else EngineConfig(backend="sdpa", dtype="float32",
                                                                               max_model_len=256)
    engine = Engine.from_pretrained("smollm2", config)
    engine.add_request(list(range(100, 164)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(3):  # prefill + two decode steps outside the count
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    ops = [e for e in events if e.name.startswith(("aten::", "kvcore::"))
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith(("aten::", "kvcore::")))]
    print(f"one decode step: {len(top)} top-level ATen calls, {len(ops)} with kvcore's operators, "
          f"{len(events)} profiler events in all")
    most = collections.Counter(e.name for e in ops).most_common(12)
    print("most called:", ", ".join(f"{name} {n}" for name, n in most))


if __name__ == "__main__":
    main()
