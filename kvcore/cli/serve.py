"""``kvcore serve``: the OpenAI-compatible HTTP server (kvcore/serving)."""

from __future__ import annotations

import argparse
import os
import sys

from kvcore.cli.settings import resolve_settings
from kvcore.engine.threads import apply_threads

__all__ = ["run_serve"]


def run_serve(args: argparse.Namespace) -> int:
    from kvcore.engine.file_config import load_config
    from kvcore.serving.server import DEFAULT_MAX_NUM_SEQS, build_engine, run_server

    s = resolve_settings(args)
    apply_threads(s.get("threads"))
    if args.max_num_seqs is None and (not args.config or load_config(args.config).max_num_seqs is None):
        s["max_num_seqs"] = DEFAULT_MAX_NUM_SEQS  # a server runs many requests; `generate` runs one
    s["model_cache"] = False if getattr(args, "no_model_cache", False) else None
    engine = build_engine(s)
    if args.verbose:
        print(f"kvcore: {engine.choice.describe()}", file=sys.stderr)
    return run_server(
        engine,
        model_name=args.served_model_name or s["model"],
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("KVCORE_API_KEY") or None,
        max_queue_len=args.max_queue_len,
        log_level=args.log_level,
        step_watchdog_s=args.step_watchdog_s,
        strict=args.strict,
    )
