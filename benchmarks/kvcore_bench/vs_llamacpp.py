"""``kvcore bench --llamacpp``: kvcore beside llama.cpp on the very same GGUF file, same threads.

llama.cpp runs through ``llama-cpp-python`` (``pip install 'kvcore-bench[llamacpp]'``), on the quantized
weights as stored (its own kernels); kvcore runs the configuration given on the command line (``--dtype``,
``--backend``, ``--engine-option KEY=VALUE`` for any other :class:`~kvcore.engine.config.EngineConfig`
field). Every repetition runs each workload once on each side, alternating which side goes first;
figures are medians over repetitions, ratios medians of the per-repetition ratios (kvcore / llama.cpp for
throughputs, llama.cpp / kvcore for TTFT: above 1 is kvcore ahead).

Workloads: ``decode`` (batch 1, 64-token prompt, 128 new tokens), ``decode_2k`` (batch 1 at a 2048-token
context), ``ttft_2k`` (time to first token of that 2048-token prompt), ``batch8`` (aggregate decode tok/s
of 8 concurrent requests with prompts of 12 ... 120 tokens; llama.cpp decodes all 8 in one batched
``llama_decode`` per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvcore_bench.common import (
    TEXT,
    cpu_features,
    describe_kernels,
    engine_options,
    environment,
    load_average,
    machine_line,
)
from kvcore_bench.runs import kv_run

__all__ = ["run_llamacpp", "WORKLOADS"]

WORKLOADS = ("decode", "decode_2k", "ttft_2k", "batch8")
LONG = 2048
BATCH_PROMPTS = (12, 28, 44, 60, 76, 92, 108, 120)


def _tok_s(times: list[list[float]]) -> float:
    after_first = sum(len(t) - 1 for t in times)
    span = max(t[-1] for t in times) - min(t[0] for t in times)
    return after_first / span


def alternate(jobs, kv_side, lc_side, reps: int, progress: bool = False):
    """Run every job ``reps`` times on both sides, alternating which side goes first.

    :param jobs: ``{"decode" | "long" | "batch8": (prompts, new_tokens)}``.
    :param kv_side: ``(prompts, new_tokens) -> (ttft_s, decode tok/s, token ids per prompt)``; so is
        ``lc_side``.
    :returns: ``(rows, agreement)``: one row per workload (medians, median ratio, every run), and per job
        the fraction of greedy tokens equal on both sides (position by position).
    """
    samples: dict[str, dict[str, list[float]]] = {w: {"kvcore": [], "llama.cpp": []} for w in WORKLOADS}
    agree: dict[str, list[float]] = {w: [] for w in jobs}
    for rep in range(reps):
        for job, (prompts, n) in jobs.items():
            sides = [("kvcore", kv_side), ("llama.cpp", lc_side)]
            got = {}
            for side, fn in (sides if rep % 2 == 0 else sides[::-1]):
                got[side] = fn(prompts, n)
                if progress:
                    print(f"rep {rep + 1}/{reps} {job} {side}: ttft {got[side][0] * 1e3:.0f} ms, "
                          f"{got[side][1]:.1f} tok/s", flush=True)
            for side, (ttft, tok_s, _) in got.items():
                if job == "long":
                    samples["decode_2k"][side].append(tok_s)
                    samples["ttft_2k"][side].append(ttft)
                else:
                    samples[job][side].append(tok_s)
            a, b = got["kvcore"][2], got["llama.cpp"][2]
            same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
            agree[job].append(same / sum(len(r) for r in a))
    rows = []
    for w in WORKLOADS:
        kv, lc = samples[w]["kvcore"], samples[w]["llama.cpp"]
        if not kv:
            continue
        ratios = [(y / x) if w == "ttft_2k" else (x / y) for x, y in zip(kv, lc)]
        unit = "s" if w == "ttft_2k" else "tok/s"
        rows.append({"workload": w, "unit": unit, "kvcore": statistics.median(kv), "llama.cpp": statistics.median(lc),
                     "ratio": statistics.median(ratios), "kvcore_runs": kv, "llama.cpp_runs": lc})
    return rows, {k: statistics.fmean(v) for k, v in agree.items()}


def run_llamacpp(args: argparse.Namespace) -> int:
    import torch

    from kvcore.engine.core import Engine, EngineConfig
    from kvcore.errors import ConfigError
    from kvcore.loaders.resolve import smollm2_path
    from kvcore_bench.llamacpp_runner import LlamaCppRunner, llama_cpp_version

    if llama_cpp_version() is None:
        raise ConfigError("llama-cpp-python is not installed: pip install 'kvcore-bench[llamacpp]' "
                          "(builds llama.cpp from source; CMAKE_ARGS=\"-DGGML_NATIVE=ON\" for this CPU)")
    load_start = load_average()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = smollm2_path() if args.model == "smollm2" else Path(args.model)
    reps = args.reps or (2 if args.quick else 5)
    new_tokens = 32 if args.quick else 128
    long_new = 16 if args.quick else 32
    options = engine_options(args.engine_option or [])
    config = EngineConfig(backend=args.backend, dtype=args.dtype, max_num_seqs=len(BATCH_PROMPTS),
                          max_model_len=LONG + max(new_tokens, long_new) + 16, **options)
    engine = Engine.from_pretrained(str(path), config)
    tok = engine.tokenizer
    text = tok.encode(TEXT, add_bos=False)

    def prompt(length: int, salt: int = 0) -> list[int]:
        return (text * (length // len(text) + 2))[salt : salt + length]

    runner_b1 = LlamaCppRunner(path, threads, n_ctx=LONG + long_new + 16, max_seqs=1)
    runner_b8 = LlamaCppRunner(path, threads, n_ctx=max(BATCH_PROMPTS) + new_tokens + 16, max_seqs=len(BATCH_PROMPTS))
    jobs = {  # workload -> (prompts, new tokens)
        "decode": ([prompt(64)], new_tokens),
        "long": ([prompt(LONG, 3)], long_new),
        "batch8": ([prompt(n, i) for i, n in enumerate(BATCH_PROMPTS)], new_tokens),
    }

    def kv_side(prompts, n):
        r = kv_run(engine, prompts, n)
        return r.ttft_s, r.decode_tok_s, r.token_ids

    def lc_side(prompts, n):
        runner = runner_b8 if len(prompts) > 1 else runner_b1
        ttfts, times, ids = runner.generate(prompts, n)
        return statistics.fmean(ttfts), _tok_s(times), ids

    for prompts, _ in jobs.values():  # warm-up, both sides, every shape: weights paged in, packs built, compiles done
        kv_side(prompts, 8)
        lc_side(prompts, 4)
    start = time.perf_counter()
    rows, agree = alternate(jobs, kv_side, lc_side, reps, args.progress)
    report = {
        "environment": {**environment(), **cpu_features(), "threads": threads, "llama_cpp_python": llama_cpp_version(),
                        "llama_cpp_system_info": runner_b1.system_info, "load_average": load_start,
                        "load_average_end": load_average()},
        "gguf": str(path),
        "kvcore_config": {"backend": engine.prefill_backend.name, "dtype": config.dtype, **options},
        "kvcore_kernels": describe_kernels(engine),
        "llama_cpp_batching": "batched: one llama_decode per step over all sequences (seq_id per request)",
        "reps": reps, "new_tokens": new_tokens, "long_new_tokens": long_new, "seconds": time.perf_counter() - start,
        "greedy_token_agreement": agree,
        "results": rows,
    }
    runner_b1.close()
    runner_b8.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "llamacpp.md").write_text(render(report))
    print(render(report))
    print(f"wrote {out / 'llamacpp.md'}, {out / 'llamacpp.json'}")
    return 0


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# kvcore vs llama.cpp",
        "",
        f"- command: `{env.get('command')}`",
        machine_line(env),
        f"- threads: {env['threads']} (both sides); load average at start {env.get('load_average')}, "
        f"at end {env.get('load_average_end')}",
        f"- GGUF: `{Path(report['gguf']).name}` (both sides); llama-cpp-python {env['llama_cpp_python']}, "
        f"torch {env['torch']}",
        f"- kvcore: {json.dumps(report['kvcore_config'])}; kernels: {report['kvcore_kernels']}",
        f"- llama.cpp: {report['llama_cpp_batching']}; system info: `{env['llama_cpp_system_info']}`",
        f"- {report['reps']} repetitions alternating sides; {report['new_tokens']} new tokens "
        f"({report['long_new_tokens']} at 2048 context); {report['seconds']:.0f} s",
        "",
        "| workload | kvcore | llama.cpp | kvcore / llama.cpp (speed) |",
        "|---|---|---|---|",
    ]
    names = {"decode": "decode, batch 1, 64-token prompt", "decode_2k": "decode, batch 1, 2048-token context",
             "ttft_2k": "TTFT, 2048-token prompt", "batch8": "aggregate decode, 8 concurrent requests"}
    for r in report["results"]:
        fmt = "{:.2f} s" if r["unit"] == "s" else "{:.1f} tok/s"
        lines.append(f"| {names[r['workload']]} | {fmt.format(r['kvcore'])} | {fmt.format(r['llama.cpp'])} | "
                     f"{r['ratio']:.2f}x |")
    agreement = ", ".join(f"{k} {v:.0%}" for k, v in report["greedy_token_agreement"].items())
    lines += ["", f"Greedy tokens equal to llama.cpp's (position by position): {agreement}.", ""]
    return "\n".join(lines)
