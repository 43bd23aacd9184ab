"""Start-up and memory at real model sizes: what a ``kvcore generate`` pays before its first token, what a process
holds, and what a second process of the same model adds.

For each real-shape file (:mod:`kvcore_bench.real_size`), in one run, alternating the sides rep by rep:

* **warm start**: ``kvcore generate --max-new-tokens 1 --json`` from process start to exit with the file (and the
  prepared-model cache entry) in the page cache, the default configuration; beside it the same command with
  ``--no-model-cache`` (every start builds the model from the file, as before the cache held quantized weights)
  and, with ``--baseline-kvcore PATH``, another installation's ``kvcore`` (an older commit);
* **first start after a new file**: the entry removed first (the file itself in the page cache), and the time to
  read the file from disk (its pages dropped with ``posix_fadvise``) for scale;
* **memory**: peak RSS above import (the ``--json`` result's), and the PSS a second process of the same model
  adds while the first one runs (``/proc/PID/smaps_rollup``);
* **decode**: batch-1 tokens per second (64 tokens after a 1-token prompt) of the model started from its entry
  (weights mapped from the cache file) against the one built from the file (weights packed into huge pages), both
  in one process, alternating; with ``--llamacpp``, native ``llama-bench`` tg128 on the same file between them
  (:mod:`kvcore_bench.native_llamacpp` builds it on first use), all at ``--threads``;
* **the floor**: the bytes a kvcore step streams (:mod:`kvcore_bench.floor`) times the mapped model's tok/s,
  against the read bandwidth of a buffer that size measured between the decode repetitions.

Run (a venv with kvcore and ``pip install -e ./benchmarks``)::

    python -m kvcore_bench.startup 360m 1.7b --reps 3 [--llamacpp] [--baseline-kvcore OTHER/bin/kvcore] [--json OUT]

The prepared-model cache used is ``$KVCORE_CACHE_DIR`` (else kvcore's default): the runs add its entries there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvcore_bench.native_llamacpp import build_tools, llama_bench
from kvcore_bench.real_size import cpu_summary, ensure_file

__all__ = ["main"]

# a process holding the model: loads it, generates a token, says so on stdout, waits for stdin to close
_HOLDER = """
import sys
from kvcore import Engine, SamplingParams
engine = Engine.from_pretrained(sys.argv[1])
engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_new_tokens=1))
print("ready", flush=True)
sys.stdin.read()
"""
# the model from its entry and built from the file, in one process: b1 decode of 64 tokens, alternating, and the
# read bandwidth of a buffer of the bytes a step streams between them (the floor, measured in the same minutes)
_DECODE = """
import json, statistics, sys, time
import torch
from kvcore import Engine, SamplingParams
from kvcore_bench.floor import kvcore_bytes_per_token, read_bandwidth
path, reps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
engines = {"mapped": Engine.from_pretrained(path), "built": Engine.from_pretrained(path, model_cache=False)}
ids, params = engines["built"].tokenizer.encode("Hello"), SamplingParams(max_new_tokens=64, ignore_eos=True)
step_bytes = sum(kvcore_bytes_per_token(engines["mapped"]).values())
speeds = {name: [] for name in engines}
speeds["read GB/s"] = []
for rep in range(reps + 1):
    for name, engine in engines.items():
        start = time.perf_counter()
        engine.generate([ids], params)
        if rep:  # the first rep warms up
            speeds[name].append(64 / (time.perf_counter() - start))
    if rep:
        speeds["read GB/s"].append(read_bandwidth(step_bytes, threads, seconds=1.0) / 1e9)
        torch.set_num_threads(threads)
print(json.dumps({"speeds": speeds, "step_bytes": step_bytes}))
"""


def _kvcore() -> str:
    return shutil.which("kvcore", path=str(Path(sys.executable).parent)) or "kvcore"


def _start(command: list[str]) -> tuple[float, dict]:
    """Wall seconds of ``command`` (a ``kvcore generate ... --json``) and its result object."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def _drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_seconds(path: Path) -> float:
    """Seconds to read ``path`` from disk (its cached pages dropped first), then left in the page cache."""
    _drop_pages(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - start


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _holders(path: Path) -> dict:
    """Two processes holding the model at once: the first one's PSS alone, and what the second adds."""
    procs = []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a process holding {path} failed")
            if len(procs) == 1:
                alone = _pss(p.pid)
        both = sum(_pss(p.pid) for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    return {"pss_first_mib": alone / 2**20, "pss_second_adds_mib": (both - alone) / 2**20}


def _decode(path: Path, reps: int, threads: int, llamacpp: Path | None) -> tuple[dict[str, list[float]], int]:
    """b1 decode tok/s of kvcore's mapped and built models, the read bandwidth (GB/s) of a step's bytes, and
    llama-bench tg128, between repetitions; and the bytes a kvcore step streams."""
    speeds: dict[str, list[float]] = {"mapped": [], "built": [], "read GB/s": [],
                                      **({"llama.cpp tg128": []} if llamacpp else {})}
    for _ in range(reps):
        command = [sys.executable, "-c", _DECODE, str(path), "1", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the decode run on {path} failed:\n{done.stderr[-2000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        for name, values in run["speeds"].items():
            speeds[name] += values
        if llamacpp:
            speeds["llama.cpp tg128"].append(float(llama_bench(llamacpp, path, threads)["avg_ts"]))
    return speeds, run["step_bytes"]


def _forget(path: Path) -> None:
    """Remove the prepared-model cache's entries of ``path``, so that the next start is its first."""
    cache = Path(os.environ.get("KVCORE_CACHE_DIR") or Path.home() / ".cache" / "kvcore") / "models"
    for entry in cache.iterdir() if cache.is_dir() else ():
        try:
            source = json.loads((entry / "meta.json").read_text()).get("source")
        except (OSError, ValueError):
            continue
        if source == str(path.resolve()):
            shutil.rmtree(entry)


def measure(shape: str, qtype: str, reps: int, baseline: str | None, threads: int = 2,
            llamacpp: Path | None = None) -> dict:
    path = ensure_file(shape, qtype)
    mib = path.stat().st_size / 2**20
    base = [_kvcore(), "generate", "--max-new-tokens", "1", "--json", "--model", str(path), "Hello"]
    sides = {"default": base, "no model cache": [*base, "--no-model-cache"]}
    if baseline:
        sides["baseline"] = [baseline, *base[1:]]
    read_s = _read_seconds(path)
    firsts = []
    for _ in range(2):
        _forget(path)
        firsts.append(_start(base)[0])
    walls: dict[str, list[float]] = {name: [] for name in sides}
    above: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(reps):
        for name, command in sides.items():
            wall, result = _start(command)
            walls[name].append(wall)
            memory = result.get("memory", {})
            if memory.get("peak_rss_bytes") and memory.get("rss_before_load_bytes"):
                above[name].append((memory["peak_rss_bytes"] - memory["rss_before_load_bytes"]) / 2**20)
    held = _holders(path)
    decode, step_bytes = _decode(path, reps, threads, llamacpp)
    return {"shape": shape, "qtype": qtype, "file_mib": round(mib, 1), "read_from_disk_s": read_s,
            "first_start_s": firsts, "warm_start_s": walls,
            "warm_start_median_s": {n: statistics.median(w) for n, w in walls.items()},
            "rss_above_import_mib": above, **held, "decode_tok_s": decode, "step_bytes": step_bytes,
            "decode_median_tok_s": {n: statistics.median(s) for n, s in decode.items()},
            "loadavg_1m": os.getloadavg()[0]}


def _table(rows: list[dict]) -> str:
    cpu, flags = cpu_summary()
    lines = [f"CPU: {cpu} ({flags}); `python -m kvcore_bench.startup {' '.join(r['shape'] for r in rows)}`", "",
             "| shape | file MiB | read from disk s | first start s | warm start s, default | no model cache | "
             "baseline | RSS above import / file | 2nd process PSS / file | b1 decode tok/s, mapped / built | "
             "llama.cpp tg128 | mapped / llama.cpp | step MiB | streamed GB/s (mapped) / read GB/s = of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med = r["warm_start_median_s"]
        rss = statistics.median(r["rss_above_import_mib"]["default"]) if r["rss_above_import_mib"]["default"] else 0
        dec = r["decode_median_tok_s"]
        lc = dec.get("llama.cpp tg128", float("nan"))
        streamed = dec["mapped"] * r["step_bytes"] / 1e9
        lines.append(
            f"| {r['shape']} {r['qtype']} | {r['file_mib']:,.0f} | {r['read_from_disk_s']:.2f} | "
            f"{' / '.join(f'{s:.1f}' for s in r['first_start_s'])} | "
            f"{med['default']:.2f} ({', '.join(f'{s:.2f}' for s in r['warm_start_s']['default'])}) | "
            f"{med['no model cache']:.2f} | {med.get('baseline', float('nan')):.2f} | {rss / r['file_mib']:.2f} | "
            f"{r['pss_second_adds_mib'] / r['file_mib']:.2f} | {dec['mapped']:.1f} / {dec['built']:.1f} | "
            f"{lc:.1f} | {dec['mapped'] / lc:.2f}x | {r['step_bytes'] / 2**20:,.0f} | "
            f"{streamed:.1f} / {dec['read GB/s']:.1f} = {streamed / dec['read GB/s']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_bench.startup", description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="+", help="real-size shapes (kvcore_bench.real_size.SHAPES)")
    parser.add_argument("--type", default="q4_1", help="the layer matrices' GGUF type")
    parser.add_argument("--reps", type=int, default=3, help="warm starts per side, alternating")
    parser.add_argument("--baseline-kvcore", default=None, metavar="PATH", help="another installation's kvcore")
    parser.add_argument("--threads", type=int, default=2, help="threads of both sides' decode")
    parser.add_argument("--llamacpp", action="store_true", help="native llama-bench tg128 beside kvcore's decode")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every measurement as JSON")
    args = parser.parse_args(argv)
    llamacpp = build_tools() if args.llamacpp else None
    rows = []
    for shape in args.shapes:
        rows.append(measure(shape, args.type, args.reps, args.baseline_kvcore, args.threads, llamacpp))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
