"""Peak RSS of `kvcore generate` above the import baseline, per configuration, against the GGUF file's size.

Each run is a fresh process; `--json` reports `memory.peak_rss_bytes` (VmHWM) and `memory.rss_before_load_bytes`
(python, torch and kvcore imported). With ``--before DIR`` (a checkout of an older kvcore, e.g.
``git archive <commit> | tar -x -C DIR``, with ``DIR/kvcore/backends`` and ``DIR/kvcore/conformance`` linked to
``DIR/backends`` and ``DIR/conformance``) every configuration also runs on that tree (``PYTHONPATH=DIR``),
alternating which goes first::

    python benchmarks/studies/memory_rss.py --before /tmp/base --repeat 2 > benchmarks/results/memory.md

``--max-new-tokens N`` runs longer generations (128 by default); ``--config NAME`` (repeatable) only those
configurations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIGS = {
    "default (no flags)": [],
    "best documented": ["--backend", "cpu_decode", "--dtype", "bfloat16", "--weights", "int4a8", "--lm-head", "int4"],
    "float32 (reference)": ["--dtype", "float32"],
}
PROMPT = "Tell me a story about a dragon."


def run(flags: list[str], pythonpath: str | None, new_tokens: int = 128) -> dict:
    kvcore = Path(sys.executable).with_name("kvcore")
    cmd = [str(kvcore), "generate", "--json", "--max-new-tokens", str(new_tokens), "--ignore-eos", *flags, PROMPT]
    env = dict(os.environ, KVCORE_MODEL_CACHE="0")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="an older kvcore tree to run side by side")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--config", action="append", choices=list(CONFIGS), help="only these configurations")
    args = ap.parse_args()
    configs = {name: CONFIGS[name] for name in args.config or CONFIGS}
    from kvcore.loaders.resolve import smollm2_path

    file_bytes = smollm2_path().stat().st_size
    trees = [("after", None)] + ([("before", args.before)] if args.before else [])
    print(f"GGUF file: {smollm2_path().name}, {file_bytes:,} bytes ({file_bytes / 2**20:.1f} MiB); "
          f"`kvcore generate --json --max-new-tokens {args.max_new_tokens} --ignore-eos FLAGS \"{PROMPT}\"`, "
          "model cache off\n")
    print("| config | tree | run | import baseline (MiB) | peak RSS (MiB) | above baseline (MiB) | × file | tok/s | "
          "stream (sha256 of the token ids) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rep in range(args.repeat):
        for name, flags in configs.items():
            order = trees if rep % 2 == 0 else trees[::-1]
            for tree, path in order:
                d = run(flags, path, args.max_new_tokens)
                m = d["memory"]
                above = m["peak_rss_bytes"] - m["rss_before_load_bytes"]
                print(f"| {name} | {tree} | {rep + 1} | {m['rss_before_load_bytes'] / 2**20:.0f} | "
                      f"{m['peak_rss_bytes'] / 2**20:.0f} | {above / 2**20:.0f} | {above / file_bytes:.2f} | "
                      f"{d['metrics']['tokens_per_s']:.1f} | {_digest(d['token_ids'])} |", flush=True)


if __name__ == "__main__":
    main()
