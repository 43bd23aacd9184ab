"""Where the time of one engine step goes: torch.profiler over kvcore decode steps (or one prefill).

    python benchmarks/studies/profile_step.py                          # sdpa, fp32, batch 1, 64-token context
    python benchmarks/studies/profile_step.py --context 2048 --prefill # the 2048-token prefill (TTFT)
    python benchmarks/studies/profile_step.py --dtype bfloat16 --batch 8 --backend paged
    python benchmarks/studies/profile_step.py --dtype bfloat16 --weights int4  # Q4_1 blocks on the int4 kernel
    python benchmarks/studies/profile_step.py --default --threads 2 --steps 100  # what `kvcore generate` runs
    python benchmarks/studies/profile_step.py --default --python 30    # and cProfile's top 30 Python functions

With ``--threads 1`` every op runs on the calling thread, so its CPU time (reported beside the wall time, and
cProfile's clock) stays meaningful on a shared machine, where wall times are not.

The summary line splits a step into its kernels (kvcore's C++ operators and the ATen GEMM / attention
calls) and everything else (Python, small ATen ops, dispatch): the unprofiled wall time minus the kernels'
self time is what the engine spends around them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.loaders import build_model, load_model
from kvcore.model.weights import uses_quantized_blocks

_GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise",
          "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def _group(name: str) -> str:
    if name.startswith("kvcore::"):
        return "kvcore kernels"
    if name in _GEMMS:
        return "GEMM"
    if "scaled_dot_product" in name or name in ("aten::_softmax", "aten::softmax"):
        return "attention"
    if name in ("aten::index_copy_", "aten::index_put_", "aten::_index_put_impl_"):
        return "KV write"
    return "everything else"


def _engine(args) -> Engine:
    max_model_len = args.context + 3 * args.steps + 16
    if args.default:  # every setting left to kvcore, as `kvcore generate` with no flags
        return Engine.from_pretrained("smollm2", EngineConfig(max_num_seqs=args.batch, max_model_len=max_model_len))
    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2", keep_quantized=uses_quantized_blocks(args.weights, dtype, "cpu"))
    model = build_model(loaded, dtype, "cpu", max_model_len, weights=args.weights)
    return Engine(model, None, EngineConfig(backend=args.backend, dtype=args.dtype, weights=args.weights,
                                            max_num_seqs=args.batch, max_model_len=max_model_len))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="float", help="matmul weight format (auto, float, int8, int4)")
    ap.add_argument("--default", action="store_true", help="kvcore's default configuration (ignores the above)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefill", action="store_true", help="profile the prefill step instead of decode")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--python", type=int, default=0, help="also print cProfile's top N functions (decode steps)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = _engine(args)
    params = SamplingParams(max_new_tokens=3 * args.steps + 8, ignore_eos=True)
    prompts = [[(7 * i + 13 * b) % 40000 + 100 for i in range(args.context)] for b in range(args.batch)]
    engine.generate([p[:32] for p in prompts], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    steps = 1 if args.prefill else args.steps
    wall, cpu = [], []
    if not args.prefill:
        engine.step()  # prefill outside the profile
        for _ in range(steps):  # unprofiled: the wall time the split below is taken from
            start, start_cpu = time.perf_counter(), time.thread_time()
            engine.step()
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - start) / steps
    config = engine.config
    print(f"{config.backend} {config.dtype} {config.weights} weights, {config.lm_head} head, batch {args.batch} "
          f"context {args.context}: {elapsed * 1e3:.2f} ms per {'prefill' if args.prefill else 'decode step'} "
          f"(profiled), {torch.get_num_threads()} threads")
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        groups[_group(event.key)] = groups.get(_group(event.key), 0.0) + event.self_cpu_time_total
    total = sum(groups.values())
    print("self CPU per step: " + ", ".join(
        f"{k} {v / steps / 1e3:.2f} ms ({100 * v / total:.0f}%)" for k, v in sorted(groups.items())))
    if wall:
        kernels = sum(v for k, v in groups.items() if k != "everything else") / steps / 1e6
        median = statistics.median(wall)
        print(f"unprofiled step: median {median * 1e3:.2f} ms, min {min(wall) * 1e3:.2f} ms, this thread's CPU time "
              f"median {statistics.median(cpu) * 1e3:.2f} ms; kernels (profiled) {kernels * 1e3:.2f} ms, the rest "
              f"(Python, small ops, dispatch) {(median - kernels) * 1e3:.2f} ms")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.python and not args.prefill:
        # this thread's CPU time, not wall time: on a shared machine a preempted call would count the wait
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.python)


if __name__ == "__main__":
    main()
