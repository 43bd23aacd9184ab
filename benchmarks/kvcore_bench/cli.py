"""The ``kvcore bench`` command line, kept apart from the harness so that declaring it costs no imports."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["CASES", "DEFAULT_BACKENDS", "add_parser"]

CASES = ("decode", "long", "bf16", "batch", "capacity", "scaling", "chunked", "speculative")
DEFAULT_BACKENDS = ("naive", "sdpa", "paged")


def add_parser(subparsers, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark backends (TTFT, TPOT, tokens/s, memory), side by side with transformers",
        description="Benchmark kvcore's attention backends on the embedded SmolLM2 through the Engine API, "
        "alternating with Hugging Face transformers on the same weights when it is installed. Writes "
        "results.md, results.json and a decode-step-vs-context PNG to --out.",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions, tokens and contexts (a few minutes)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help=f"comma-separated backends to measure (default {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    p.add_argument("--out", default="bench-out", metavar="DIR", help="output directory (default bench-out/)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases (default all: {','.join(CASES)})")
    p.add_argument("--model", default="smollm2", help="model spec (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default 0: torch's default; 2 for --real-size)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 2 quick / 5 full)")
    p.add_argument("--no-progress", action="store_true", help="do not print progress on stderr")
    p.add_argument("--llamacpp", action="store_true",
                   help="instead: kvcore vs llama.cpp on the same GGUF (llama-cpp-python; llamacpp.md/json)")
    p.add_argument("--llamacpp-native", action="store_true",
                   help="instead: kvcore's defaults (CLI and in-process) vs native llama-bench / llama-batched-bench, "
                        "built on first use from the llama-cpp-python sdist (native.md/json)")
    p.add_argument("--scale", action="store_true",
                   help="instead: aggregate decode tok/s at 1/8/32/64 concurrent requests and at an 8k context, "
                        "kvcore (paged + prefix caching, and the defaults) vs native llama-batched-bench "
                        "(scale-curves.md/json/png)")
    p.add_argument("--real-size", default=None, metavar="FILES",
                   help="instead: start-up, memory, decode, prefill and 8 concurrent requests at real model sizes "
                        "(comma-separated SHAPE[:TYPE], e.g. 360m,1.7b,3b,8b or 1.7b:q4_k; random weights in "
                        "real-shape GGUFs written on first use) vs native llama.cpp on the same files "
                        "(real-size.md/json/png)")
    p.add_argument("--no-llamacpp", action="store_true", help="--real-size: measure kvcore alone")
    p.add_argument("--backend", default=None, help="--llamacpp: kvcore's backend (default: the engine's choice)")
    p.add_argument("--dtype", default="float32", help="--llamacpp: kvcore's dtype (default float32)")
    p.add_argument("--engine-option", action="append", metavar="KEY=VALUE",
                   help="--llamacpp / --llamacpp-native / --scale (in-process engine): another EngineConfig field "
                        "for kvcore (VALUE: JSON or a string); repeatable")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p
