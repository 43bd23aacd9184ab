"""Where the time of one engine step goes: torch.profiler over kvcore decode steps (or one prefill).

    python benchmarks/profile_step.py                          # sdpa, fp32, batch 1, 64-token context
    python benchmarks/profile_step.py --context 2048 --prefill # the 2048-token prefill (TTFT)
    python benchmarks/profile_step.py --dtype bfloat16 --batch 8 --backend paged
    python benchmarks/profile_step.py --dtype bfloat16 --weights int4   # the GGUF's Q4_1 blocks on the int4 kernel
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.loaders import build_model, load_model
from kvcore.model.weights import uses_quantized_blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="float", help="matmul weight format (auto, float, int8, int4)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefill", action="store_true", help="profile the prefill step instead of decode")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model("smollm2", keep_quantized=uses_quantized_blocks(args.weights, dtype, "cpu"))
    max_model_len = args.context + args.steps + 16
    model = build_model(loaded, dtype, "cpu", max_model_len, weights=args.weights)
    engine = Engine(model, None, EngineConfig(backend=args.backend, dtype=args.dtype, weights=args.weights,
                                               max_num_seqs=args.batch, max_model_len=max_model_len))
    params = SamplingParams(max_new_tokens=args.steps + 8, ignore_eos=True)
    prompts = [[(7 * i + 13 * b) % 40000 + 100 for i in range(args.context)] for b in range(args.batch)]
    engine.generate([p[:32] for p in prompts], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    if not args.prefill:
        engine.step()  # prefill outside the profile
        for _ in range(3):
            engine.step()
    steps = 1 if args.prefill else args.steps
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - start) / steps
    print(f"{args.backend} {args.dtype} {model.weight_format} weights batch {args.batch} context {args.context}: "
          f"{elapsed * 1e3:.1f} ms per {'prefill' if args.prefill else 'decode step'} (profiled), "
          f"{torch.get_num_threads()} threads")
    groups = {"GEMM": 0.0, "attention": 0.0, "KV write": 0.0, "everything else": 0.0}
    for event in prof.key_averages():
        name = event.key
        if name in ("aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise",
                    "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm"):
            groups["GEMM"] += event.self_cpu_time_total
        elif "scaled_dot_product" in name or name in ("aten::_softmax", "aten::softmax"):
            groups["attention"] += event.self_cpu_time_total
        elif name in ("aten::index_copy_", "aten::index_put_", "aten::_index_put_impl_"):
            groups["KV write"] += event.self_cpu_time_total
        else:
            groups["everything else"] += event.self_cpu_time_total
    total = sum(groups.values())
    print("self CPU per step: " + ", ".join(
        f"{k} {v / steps / 1e3:.1f} ms ({100 * v / total:.0f}%)" for k, v in groups.items()))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
