"""When does ``kvcore generate --compile`` pay for its compilation? Whole processes, eager against compiled.

    python benchmarks/studies/compile_break_even.py --threads 2 --tokens 32,128,512,2048 --out benchmarks/results

For every token count, alternating the order: ``kvcore generate`` without ``--compile``, and with ``--compile`` on
a warm Inductor cache (a process reusing what an earlier one compiled: ``TORCHINDUCTOR_CACHE_DIR`` one directory
for the whole run; the FX-graph and AOT-autograd caches live under it). At the first count only, before the warm
run, ``--compile`` on that directory while still empty (cold: nothing compiled before is reused); what it costs
does not depend on the token count (every compile happens in the first decode steps), so the cold line is the
warm one shifted by that difference. Each run is timed from process start to exit (start-up, load, prefill, the
compiles, decode), the default configuration otherwise, greedy with ``--ignore-eos``.

A line ``wall = a + b * tokens`` is fitted per mode (least squares over the token counts); the break-even is
where the compiled line crosses the eager one. Writes ``compile-break-even.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvcore_bench.common import TEXT, cpu_features, environment, load_average

MODES = ("eager", "compile_cold", "compile_warm")


def generate(threads: int, tokens: int, compile_: bool, cache_dir: str) -> dict:
    """One ``kvcore generate`` process: its wall time and its ``--json`` metrics."""
    command = [sys.executable, "-m", "kvcore.cli", "generate", "--threads", str(threads), "--max-new-tokens",
               str(tokens), "--ignore-eos", "--json", *(["--compile"] if compile_ else []), TEXT[:200]]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"kvcore generate failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "ttft_s": out["metrics"]["ttft_s"], "tpot_s": out["metrics"]["tpot_s"],
            "generated": len(out["token_ids"]), "compile": out["compile"], "load_average": load_average()}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``wall = a + b * tokens``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def break_even(eager: tuple[float, float], compiled: tuple[float, float]) -> float | None:
    """Tokens where the two lines cross (None: the compiled one is never below)."""
    (a_e, b_e), (a_c, b_c) = eager, compiled
    if b_c >= b_e:
        return None
    return max(0.0, (a_c - a_e) / (b_e - b_c))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="32,128,512,2048")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    eager_dir = tempfile.mkdtemp(prefix="kvc-inductor-eager-")  # an eager run compiles nothing into it
    generate(args.threads, 8, False, eager_dir)  # the prepared-model cache is written once, before any timing
    runs: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvc-inductor-") as cache:
        for i, n in enumerate(counts):
            cold = i == 0
            order = [("eager", False), ("compile_cold" if cold else "compile_warm", True)]
            for mode, comp in order if i % 2 == 0 else order[::-1]:
                runs[mode][n] = generate(args.threads, n, comp, cache if comp else eager_dir)
            if cold:
                runs["compile_warm"][n] = generate(args.threads, n, True, cache)
            print(f"{n} tokens: " + ", ".join(f"{m} {runs[m][n]['wall_s']:.1f} s (TPOT {runs[m][n]['tpot_s'] * 1e3:.1f}"
                                              " ms)" for m in MODES if n in runs[m]), file=sys.stderr, flush=True)
    lines = {m: fit([(n, r["wall_s"]) for n, r in runs[m].items()]) for m in ("eager", "compile_warm")}
    for n0, c in runs["compile_cold"].items():  # the warm line, shifted by what the cold run cost more
        lines["compile_cold"] = (lines["compile_warm"][0] + c["wall_s"] - runs["compile_warm"][n0]["wall_s"],
                                 lines["compile_warm"][1])
    report = {
        "environment": {**environment(), **cpu_features(), "threads": args.threads, "load_average_end": load_average(),
                        "command": "python benchmarks/studies/compile_break_even.py " + " ".join(sys.argv[1:])},
        "seconds": time.perf_counter() - start, "runs": runs,
        "fit": {m: {"a_s": a, "b_s_per_token": b} for m, (a, b) in lines.items()},
        "break_even_tokens": {m: break_even(lines["eager"], lines[m]) for m in lines if m != "eager"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile-break-even.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render(report))


def render(report: dict) -> str:
    lines = ["| new tokens | eager wall | compiled, cold cache | compiled, warm cache | eager TPOT "
             "| compiled TPOT (warm) |", "|---:|---:|---:|---:|---:|---:|"]
    for n in report["runs"]["eager"]:
        e, w = report["runs"]["eager"][n], report["runs"]["compile_warm"][n]
        c = report["runs"]["compile_cold"].get(n)
        cold = f"{c['wall_s']:.1f} s" if c else "–"
        lines.append(f"| {n} | {e['wall_s']:.1f} s | {cold} | {w['wall_s']:.1f} s | "
                     f"{e['tpot_s'] * 1e3:.1f} ms | {w['tpot_s'] * 1e3:.1f} ms |")
    fits = ", ".join(f"{m}: {f['a_s']:.1f} s + {f['b_s_per_token'] * 1e3:.2f} ms/token"
                     for m, f in report["fit"].items())
    be = report["break_even_tokens"]
    fmt = ", ".join(f"{k.removeprefix('compile_')} {'never' if v is None else f'{v:.0f} tokens'}"
                    for k, v in be.items())
    return "\n".join(lines + ["", f"Fits: {fits}.", f"Break-even: {fmt}."])


if __name__ == "__main__":
    main()
