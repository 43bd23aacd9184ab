"""``kvcore bench --llamacpp-native``: kvcore's defaults beside native llama.cpp (``llama-bench``,
``llama-batched-bench``, :mod:`kvcore_bench.native_llamacpp`) on the very same GGUF file, same threads.

Each repetition runs, alternating which side goes first (figures are medians; ratios medians of the
per-repetition ratios, kvcore / llama.cpp):

* ``cli_b1``: ``kvcore generate`` with no configuration flags (a fresh process: start-up, kernels, the default
  configuration as a user meets it), 64-token prompt, 128 new tokens, its ``--json`` TPOT -> tok/s and peak RSS,
  against ``llama-bench -p 0 -n 128`` (tg128);
* ``api_b1``: the same default configuration in this process (``Engine.from_pretrained`` with no settings),
  warmed up, against the same tg128;
* ``batch8``: 8 concurrent requests of 64-token prompts, 128 new tokens each, aggregate decode tok/s, against
  ``llama-batched-bench -npp 64 -ntg 128 -npl 8`` (``speed_tg``).

``--engine-option KEY=VALUE`` (repeatable) configures the in-process engine (``api_b1``, ``batch8``) beyond the
defaults, to measure a tuned configuration beside them; ``cli_b1`` stays the flag-less default.

The load average is recorded per repetition: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
from kvcore_bench.native_llamacpp import batched_bench, build_tools, llama_bench
from kvcore_bench.runs import kv_run

__all__ = ["run_native", "render_native"]

PROMPT_TOKENS = 64
NEW_TOKENS = 128
BATCH = 8


def _cli_run(path: Path, threads: int, prompt: str, new_tokens: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "kvcore.cli", "generate", "--model", str(path), "--threads", str(threads),
               "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json", prompt]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        from kvcore.errors import ConfigError

        raise ConfigError(f"kvcore generate failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_native(args: argparse.Namespace) -> int:
    import torch

    from kvcore.engine.core import Engine, EngineConfig
    from kvcore.loaders.resolve import smollm2_path

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = smollm2_path() if args.model == "smollm2" else Path(args.model)
    reps = args.reps or (2 if args.quick else 5)
    bin_dir = build_tools(progress=args.progress)
    options = engine_options(args.engine_option or [])
    engine = Engine.from_pretrained(str(path), EngineConfig(max_num_seqs=BATCH,
                                                           max_model_len=PROMPT_TOKENS + NEW_TOKENS + 16, **options))
    text = engine.tokenizer.encode(TEXT, add_bos=False)
    prompts = [(text * 4)[i : i + PROMPT_TOKENS] for i in range(BATCH)]
    prompt_text = engine.tokenizer.decode(prompts[0])
    kv_run(engine, prompts[:1], 8)  # warm-up: kernels built, weights paged in
    kv_run(engine, prompts, 8)

    def kvcore_side() -> dict[str, float]:
        cli = _cli_run(path, threads, prompt_text, NEW_TOKENS)
        b1 = kv_run(engine, prompts[:1], NEW_TOKENS)
        b8 = kv_run(engine, prompts, NEW_TOKENS)
        memory = cli["memory"]
        return {"cli_b1": 1 / cli["metrics"]["tpot_s"], "api_b1": b1.decode_tok_s, "batch8": b8.decode_tok_s,
                "cli_peak_rss_mib": memory["peak_rss_bytes"] / 2**20,
                "cli_rss_above_import_mib": (memory["peak_rss_bytes"] - memory["rss_before_load_bytes"]) / 2**20,
                "cli_config": cli["choice"]}

    def llamacpp_side() -> dict[str, Any]:
        tg = llama_bench(bin_dir, path, threads, NEW_TOKENS)
        (b8,) = batched_bench(bin_dir, path, threads, [BATCH], PROMPT_TOKENS, NEW_TOKENS,
                              ctx=BATCH * (PROMPT_TOKENS + NEW_TOKENS) + 64)
        return {"tg128": tg["avg_ts"], "batch8": b8["speed_tg"], "info": tg}

    runs = []
    start = time.perf_counter()
    for rep in range(reps):
        load = load_average()
        sides = [("kvcore", kvcore_side), ("llama.cpp", llamacpp_side)]
        got = {}
        for side, fn in sides if rep % 2 == 0 else sides[::-1]:
            got[side] = fn()
        kv, lc = got["kvcore"], got["llama.cpp"]
        run = {"rep": rep, "load_average": load, "kvcore": {k: v for k, v in kv.items() if k != "cli_config"},
               "llama.cpp": {"tg128": lc["tg128"], "batch8": lc["batch8"]},
               "ratios": {"cli_b1": kv["cli_b1"] / lc["tg128"], "api_b1": kv["api_b1"] / lc["tg128"],
                          "batch8": kv["batch8"] / lc["batch8"]}}
        runs.append(run)
        if args.progress:
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in run["ratios"].items())
            print(f"rep {rep + 1}/{reps} (load {load}): {ratios}", file=sys.stderr, flush=True)
    info = lc["info"]
    report = {
        "environment": {**environment(), **cpu_features(), "threads": threads, "load_average_end": load_average()},
        "gguf": str(path), "gguf_bytes": path.stat().st_size,
        "kvcore_default": kv["cli_config"], "kvcore_options": options, "kvcore_kernels": describe_kernels(engine),
        "llama_cpp": {"tools": str(bin_dir), **{k: info.get(k) for k in ("build_commit", "cpu_info", "backends",
                                                                       "type_k", "n_threads")}},
        "reps": reps, "seconds": time.perf_counter() - start, "runs": runs,
        "median": {k: statistics.median(r["ratios"][k] for r in runs) for k in runs[0]["ratios"]},
        "median_rss_above_import_mib": statistics.median(r["kvcore"]["cli_rss_above_import_mib"] for r in runs),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "native.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "native.md").write_text(render_native(report))
    print(render_native(report))
    print(f"wrote {out / 'native.md'}, {out / 'native.json'}")
    return 0


def render_native(report: dict[str, Any]) -> str:
    env, lc = report["environment"], report["llama_cpp"]
    gguf_mib = report["gguf_bytes"] / 2**20
    chosen = {k: v for k, v in report["kvcore_default"].items() if k != "reasons"}
    lines = [
        "# kvcore defaults vs native llama.cpp",
        "",
        f"- command: `{env.get('command')}`",
        machine_line(env),
        f"- threads: {env['threads']} (both sides); load average at end {env['load_average_end']}",
        f"- GGUF: `{Path(report['gguf']).name}` ({gguf_mib:.1f} MiB), both sides",
        f"- kvcore default (no flags): {json.dumps(chosen)}; kernels: {report['kvcore_kernels']}",
        f"- in-process engine options beyond the defaults: {json.dumps(report.get('kvcore_options') or {})}",
        f"- llama.cpp: native llama-bench / llama-batched-bench, commit {lc['build_commit']}, "
        f"backends {lc['backends']}, CPU info `{lc['cpu_info']}`",
        f"- {report['reps']} repetitions alternating sides; {report['seconds']:.0f} s",
        "",
        "| rep | load avg | kvcore generate (no flags) tok/s | in-process tok/s | 8 concurrent tok/s | llama.cpp tg128 "
        "| llama.cpp batched 8 | CLI / tg128 | in-process / tg128 | 8 conc. / batched 8 | CLI peak RSS above import |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        kv, lcr, ra = r["kvcore"], r["llama.cpp"], r["ratios"]
        lines.append(f"| {r['rep'] + 1} | {r['load_average']} | {kv['cli_b1']:.1f} | {kv['api_b1']:.1f} | "
                     f"{kv['batch8']:.1f} | {lcr['tg128']:.1f} | {lcr['batch8']:.1f} | {ra['cli_b1']:.2f}x | "
                     f"{ra['api_b1']:.2f}x | {ra['batch8']:.2f}x | {kv['cli_rss_above_import_mib']:.0f} MiB "
                     f"({kv['cli_rss_above_import_mib'] / gguf_mib:.1f}x file) |")
    m = report["median"]
    lines += ["", f"Medians of the per-repetition ratios: CLI {m['cli_b1']:.2f}x, in-process {m['api_b1']:.2f}x, "
                  f"8 concurrent {m['batch8']:.2f}x; CLI peak RSS above the import baseline "
                  f"{report['median_rss_above_import_mib']:.0f} MiB.", ""]
    return "\n".join(lines)
