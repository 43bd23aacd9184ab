"""``kvcore bench --real-size``: kvcore at real model sizes, beside native llama.cpp on the very same files.

For each real-shape file (:mod:`kvcore_bench.real_size`: ``SHAPE`` or ``SHAPE:TYPE``, Q4_1 by default), in one
run, repetitions alternating which side goes first (figures are medians):

* **start → first token** of ``kvcore generate --max-new-tokens 1 --json`` (process start to exit), the default
  configuration: *first* (the prepared-model cache's entry removed, the file in the page cache; twice), *cold*
  (the entry present, its pages and the file's dropped with ``posix_fadvise``), *warm* (both in the page cache),
  and *built* (``--no-model-cache``: the model built from the file at every start); beside them the seconds to read
  the file from disk, for scale;
* **memory**: the warm start's peak RSS above import (its ``--json`` result's), and the PSS a second process
  holding the model adds while a first one runs (``/proc/PID/smaps_rollup``), less what a process that imports
  kvcore and loads nothing adds the same way (the interpreter's, torch's and kvcore's own heap: not the model's);
* **speed**, in one process per repetition: batch-1 decode (64 tokens after a 16-token prompt) of the model
  mapped from its entry and of the one built from the file, prefill of a 512-token prompt, and 8 concurrent
  requests (16-token prompts, 64 new tokens: aggregate decode tok/s); native ``llama-bench`` tg128 and pp512 and
  ``llama-batched-bench -npl 8`` (the same prompt and generation lengths) on the same file, between them;
* **the floor**: the bytes a kvcore step streams (:mod:`kvcore_bench.floor`) times the mapped model's tok/s,
  against the read bandwidth of a buffer that size measured in the same process.

``--out DIR`` gets ``real-size.md`` (one table), ``real-size.json`` (every measurement) and ``real-size.png``.
Files are written on first use into the benchmark cache (an 8B one is 4.4 GiB); llama.cpp's tools are built on
first use (:mod:`kvcore_bench.native_llamacpp`); ``--no-llamacpp`` measures kvcore alone.
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
from typing import Any

import gguf

from kvcore.loaders.model_cache import cache_dir as model_cache_dir
from kvcore_bench.native_llamacpp import batched_bench, build_tools, llama_bench
from kvcore_bench.real_size import QTYPES, SHAPES, cpu_summary, ensure_file
from kvcore_bench.sizes_report import plot, render

__all__ = ["parse_files", "measure", "prepared_entries", "run_real_size"]

PREFILL = 512
BATCH, BATCH_PROMPT, NEW_TOKENS = 8, 16, 64

# a process holding the model: loads it, generates a token, says so on stdout, waits for stdin to close; with no
# file, it imports what such a process imports and loads nothing
_HOLDER = """
import sys
from kvcore import Engine, SamplingParams
if sys.argv[1:]:
    engine = Engine.from_pretrained(sys.argv[1])
    engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_new_tokens=1))
print("ready", flush=True)
sys.stdin.read()
"""
# one repetition of the in-process figures: the model from its entry ("mapped") and built from the file
_SPEED = """
import json, random, sys
import torch
from kvcore import Engine, EngineConfig
from kvcore_bench.floor import kvcore_bytes_per_token, read_bandwidth
from kvcore_bench.runs import kv_run
path, threads, prefill, batch, prompt_len, new = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(threads)
config = EngineConfig(max_num_seqs=batch, max_model_len=prefill + new + 16)
engines = {"mapped": Engine.from_pretrained(path, config), "built": Engine.from_pretrained(path, config,
                                                                                        model_cache=False)}
rng = random.Random(0)
vocab = engines["mapped"].model.config.vocab_size
prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
long = [rng.randrange(vocab) for _ in range(prefill)]
out = {}
for name, engine in engines.items():
    kv_run(engine, prompts[:1], 8)  # warm-up: kernels loaded, weights paged in
    out[f"b1 {name}"] = kv_run(engine, prompts[:1], new).decode_tok_s
engine = engines["mapped"]
kv_run(engine, [long[:64]], 1)
out["prefill"] = prefill / kv_run(engine, [long], 1).ttft_s
out["batch"] = kv_run(engine, prompts, new).decode_tok_s
out["step bytes"] = sum(kvcore_bytes_per_token(engine).values())
out["read GB/s"] = read_bandwidth(out["step bytes"], threads, seconds=1.0) / 1e9
print(json.dumps(out))
"""


def parse_files(spec: str) -> list[tuple[str, str]]:
    """``"360m,1.7b:q4_0"`` -> ``[("360m", "q4_1"), ("1.7b", "q4_0")]``; SystemExit naming what is unknown."""
    files = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        shape, _, qtype = item.partition(":")
        qtype = qtype or "q4_1"
        if shape not in SHAPES or qtype not in QTYPES:
            raise SystemExit(f"kvcore bench --real-size: {item!r} is not SHAPE[:TYPE] with SHAPE one of "
                             f"{', '.join(SHAPES)} and TYPE one of {', '.join(QTYPES)}")
        block = gguf.GGML_QUANT_SIZES[QTYPES[qtype]][0]
        dims = SHAPES[shape]
        if any(n % block for n in (dims.hidden, dims.ffn, dims.heads * dims.head_dim)):
            raise SystemExit(f"kvcore bench --real-size: {qtype} stores rows in blocks of {block} values, and "
                             f"{shape}'s rows (hidden {dims.hidden}, ffn {dims.ffn}) are not all whole blocks")
        files.append((shape, qtype))
    if not files:
        raise SystemExit("kvcore bench --real-size: name at least one SHAPE[:TYPE]")
    return files


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


def prepared_entries(path: Path) -> list[Path]:
    """The prepared-model cache's entries made from ``path``."""
    cache, found = model_cache_dir(), []
    for entry in cache.iterdir() if cache.is_dir() else ():
        try:
            if json.loads((entry / "meta.json").read_text()).get("source") == str(path.resolve()):
                found.append(entry)
        except (OSError, ValueError):
            continue
    return found


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _holders(path: Path) -> dict[str, float]:
    """PSS (MiB) of one process holding the model alone, what a second one adds, and what a process that loads
    nothing adds beside the first."""
    procs: list[subprocess.Popen] = []

    def hold(*args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a process holding {path} failed")
        return p

    def release(p: subprocess.Popen) -> None:
        p.stdin.close()
        p.wait()
        procs.remove(p)

    try:
        first = hold(str(path))
        alone = _pss(first.pid)
        bare = hold()
        with_bare = _pss(first.pid) + _pss(bare.pid)
        release(bare)
        alone_now = _pss(first.pid)
        second = hold(str(path))
        both = _pss(first.pid) + _pss(second.pid)
    finally:
        for p in list(procs):
            release(p)
    mib = 2**20
    return {"pss_first_mib": alone / mib, "pss_second_adds_mib": (both - alone_now) / mib,
            "pss_bare_adds_mib": (with_bare - alone) / mib}


def _speed(path: Path, threads: int, bin_dir: Path | None, kvcore_first: bool) -> dict[str, Any]:
    """One repetition of the speed figures, kvcore's and (with ``bin_dir``) llama.cpp's, in the order given."""

    def kvcore_side() -> dict[str, float]:
        command = [sys.executable, "-c", _SPEED, str(path), str(threads), str(PREFILL), str(BATCH),
                   str(BATCH_PROMPT), str(NEW_TOKENS)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the speed run on {path} failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def llamacpp_side() -> dict[str, float]:
        (b8,) = batched_bench(bin_dir, path, threads, [BATCH], BATCH_PROMPT, NEW_TOKENS,
                              ctx=BATCH * (BATCH_PROMPT + NEW_TOKENS) + 64)
        return {"llama.cpp tg128": float(llama_bench(bin_dir, path, threads)["avg_ts"]),
                "llama.cpp pp512": float(llama_bench(bin_dir, path, threads, n_gen=0, n_prompt=PREFILL)["avg_ts"]),
                "llama.cpp batch": float(b8["speed_tg"])}

    sides = [kvcore_side] + ([llamacpp_side] if bin_dir else [])
    got: dict[str, Any] = {}
    for side in sides if kvcore_first else sides[::-1]:
        got.update(side())
    return got


def measure(shape: str, qtype: str, reps: int, threads: int, bin_dir: Path | None,
            progress: bool = False) -> dict[str, Any]:
    """Every figure of one file (written first if absent)."""

    def say(what: str) -> None:
        if progress:
            print(f"[{shape} {qtype}] {what}", file=sys.stderr, flush=True)

    path = ensure_file(shape, qtype)
    base = [_kvcore(), "generate", "--max-new-tokens", "1", "--json", "--threads", str(threads), "--model",
            str(path), "Hello"]
    say("reading the file from disk")
    read_s = _read_seconds(path)
    firsts = []
    for _ in range(2):
        for entry in prepared_entries(path):
            shutil.rmtree(entry)
        firsts.append(_start(base)[0])
    say(f"first starts {firsts}")
    starts: dict[str, list[float]] = {"cold": [], "warm": [], "built": []}
    above: list[float] = []
    for rep in range(reps):
        for entry in prepared_entries(path):
            _drop_pages(entry / "model.pt")
        _drop_pages(path)
        starts["cold"].append(_start(base)[0])
        for name in ("warm", "built") if rep % 2 == 0 else ("built", "warm"):
            wall, result = _start(base if name == "warm" else [*base, "--no-model-cache"])
            starts[name].append(wall)
            if name == "warm":
                memory = result["memory"]
                above.append((memory["peak_rss_bytes"] - memory["rss_before_load_bytes"]) / 2**20)
    say(f"starts {starts}")
    held = _holders(path)
    speeds: dict[str, list[float]] = {}
    for rep in range(reps):
        for key, value in _speed(path, threads, bin_dir, kvcore_first=rep % 2 == 0).items():
            speeds.setdefault(key, []).append(value)
        say(f"speed rep {rep + 1}/{reps}")
    return {"shape": shape, "qtype": qtype, "file": str(path), "file_mib": path.stat().st_size / 2**20,
            "read_from_disk_s": read_s, "first_start_s": firsts, "start_s": starts,
            "rss_above_import_mib": above, **held, "speeds": speeds,
            "median": {**{f"{k} start": statistics.median(v) for k, v in starts.items()},
                       **{k: statistics.median(v) for k, v in speeds.items()},
                       "rss above import": statistics.median(above)},
            "loadavg_1m": os.getloadavg()[0]}


def run_real_size(args: argparse.Namespace) -> int:
    """``kvcore bench --real-size FILES``: measure, then write the table, the JSON and the plot to ``--out``."""
    files = parse_files(args.real_size)
    threads = args.threads or 2
    reps = args.reps or (1 if args.quick else 3)
    bin_dir = None if args.no_llamacpp else build_tools(progress=args.progress)
    cpu, flags = cpu_summary()
    env = {"cpu": cpu, "flags": flags, "threads": threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_start": round(os.getloadavg()[0], 2)}
    rows = [measure(shape, qtype, reps, threads, bin_dir, args.progress) for shape, qtype in files]
    env["load_end"] = round(os.getloadavg()[0], 2)
    command = f"kvcore bench --real-size {args.real_size} --reps {reps}" + (" --no-llamacpp" if not bin_dir else "")
    report = {"environment": env, "command": command, "reps": reps, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real-size.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "real-size.md").write_text(render(report))
    png = plot(report, out)
    print(render(report))
    print(f"wrote {out / 'real-size.md'}, {out / 'real-size.json'}, {png}")
    return 0
