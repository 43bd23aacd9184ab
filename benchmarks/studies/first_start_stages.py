"""Where a first start's seconds go: wall, user and system time of each stage of ``Engine.from_pretrained`` on a
GGUF file whose prepared-model entry is removed first (the file itself in the page cache), then of a start from the
entry just written, and of one with the cache off. System time is the kernel's: page faults of new memory and the
page cache of the entry being written. Linux::

    python benchmarks/studies/first_start_stages.py FILE [--runs 2]

Each run is a fresh process (``--child``), so imports and page-cache state are a real start's.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _clock() -> tuple[float, float, float]:
    t = os.times()
    return time.perf_counter(), t.user, t.system


def _child(path: str, cache: bool) -> None:
    started = time.perf_counter()
    from kvcore import Engine, SamplingParams
    from kvcore.loaders import model_cache

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            a = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                b = _clock()
                print(f"  {name:<14} wall {b[0] - a[0]:5.2f}  user {b[1] - a[1]:5.2f}  sys {b[2] - a[2]:5.2f}")

        return wrapper

    # the stages model_cache.load_pretrained calls, by the names it looks them up with
    for name in ("load_model", "build_model", "prepare_head", "_write", "_read"):
        setattr(model_cache, name, timed(name, getattr(model_cache, name)))
    print(f"  {'import':<14} wall {time.perf_counter() - started:5.2f}")
    a = _clock()
    engine = Engine.from_pretrained(path, model_cache=cache)
    engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_new_tokens=1))
    b = _clock()
    print(f"  {'load + token':<14} wall {b[0] - a[0]:5.2f}  user {b[1] - a[1]:5.2f}  sys {b[2] - a[2]:5.2f}")
    print(f"  {'total':<14} wall {time.perf_counter() - started:5.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--child", choices=("cache", "no-cache"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.file, args.child == "cache")
        return 0
    from kvcore_bench.sizes import prepared_entries  # here: it imports kvcore, which the child must time

    for run in range(args.runs):
        for entry in prepared_entries(Path(args.file)):
            shutil.rmtree(entry)
        for label, mode in (("first start", "cache"), ("from the entry", "cache"), ("cache off", "no-cache")):
            print(f"run {run + 1}, {label}:", flush=True)
            subprocess.run([sys.executable, __file__, args.file, "--child", mode], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
