"""The table and the plot of a ``kvcore bench --real-size`` run (:mod:`kvcore_bench.sizes`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot", "render"]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def render(report: dict[str, Any]) -> str:
    """The one Markdown table (and its legend) of a run."""
    env = report["environment"]
    lines = [f"CPU: {env['cpu']} ({env['flags']}), {env['threads']} threads; `{report['command']}`; "
             f"{env['date']}, load average {env['load_start']} at the start, {env['load_end']} at the end", "",
             "| file | MiB | read from disk s | first start s | cold / warm start s | built s | RSS above import "
             "/ file | 2nd process PSS / file (less a bare process) | b1 decode tok/s, mapped / built | llama.cpp "
             "tg128 | b1 / llama.cpp | of the floor | prefill 512 tok/s / llama.cpp pp512 | 8 concurrent tok/s / "
             "llama.cpp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        m, mib = r["median"], r["file_mib"]
        streamed = m["b1 mapped"] * m["step bytes"] / 1e9
        lc = {k: m.get(f"llama.cpp {k}") for k in ("tg128", "pp512", "batch")}
        lines.append(
            f"| {r['shape']} {r['qtype']} | {mib:,.0f} | {r['read_from_disk_s']:.2f} | "
            f"{' / '.join(f'{s:.1f}' for s in r['first_start_s'])} | {m['cold start']:.2f} / {m['warm start']:.2f} | "
            f"{m['built start']:.2f} | {m['rss above import'] / mib:.2f} | {r['pss_second_adds_mib'] / mib:.2f} "
            f"({(r['pss_second_adds_mib'] - r['pss_bare_adds_mib']) / mib:.2f}) | {m['b1 mapped']:.1f} / "
            f"{m['b1 built']:.1f} | {lc['tg128'] or float('nan'):.1f} | {_ratio(m['b1 mapped'], lc['tg128'])} | "
            f"{streamed / m['read GB/s']:.0%} | {m['prefill']:.0f} / {lc['pp512'] or float('nan'):.1f} "
            f"({_ratio(m['prefill'], lc['pp512'])}) | {m['batch']:.1f} / {lc['batch'] or float('nan'):.1f} "
            f"({_ratio(m['batch'], lc['batch'])}) |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out: Path) -> Path:
    """``out / "real-size.png"``: start-up seconds and batch-1 decode per file, with the read time and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [f"{r['shape']} {r['qtype']}" for r in rows]
    x = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("first", "first start"), ("cold", "cold start"), ("warm", "warm start")):
        values = [min(r["first_start_s"]) if key == "first" else r["median"][f"{key} start"] for r in rows]
        left.plot(x, values, marker="o", label=label)
    left.plot(x, [r["read_from_disk_s"] for r in rows], "k--", marker="x", label="reading the file from disk")
    left.set(title="kvcore generate: process start → first token", ylabel="seconds", xticks=list(x), xticklabels=names)
    left.legend()
    floor = [r["median"]["read GB/s"] * 1e9 / r["median"]["step bytes"] for r in rows]
    right.plot(x, [r["median"]["b1 mapped"] for r in rows], marker="o", label="kvcore (default)")
    if all("llama.cpp tg128" in r["median"] for r in rows):
        right.plot(x, [r["median"]["llama.cpp tg128"] for r in rows], marker="s", label="llama.cpp tg128")
    right.plot(x, floor, "k--", marker="x", label="floor: read bandwidth / bytes per step")
    right.set(title="batch-1 decode", ylabel="tokens/s", yscale="log", xticks=list(x), xticklabels=names)
    right.legend()
    fig.suptitle(f"{report['environment']['cpu']}, {report['environment']['threads']} threads")
    fig.tight_layout()
    path = out / "real-size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
