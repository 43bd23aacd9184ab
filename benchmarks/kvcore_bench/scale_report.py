"""The ``kvcore bench --scale`` report: scale-curves.md, scale-curves.json and scale-curves.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kvcore_bench.common import machine_line, pyplot

__all__ = ["render_scale", "plot_scale", "write_scale"]


def _sides(report: dict[str, Any]) -> list[str]:
    sides: list[str] = []
    for point in report["points"]:
        for run in point["runs"]:
            sides += [s for s, v in run.items() if isinstance(v, dict) and s not in sides]
    return sides


def render_scale(report: dict[str, Any]) -> str:
    env, lc, plan = report["environment"], report["llama_cpp"], report["plan"]
    lines = [
        "# Aggregate decode throughput vs concurrency and at a long context: kvcore vs native llama.cpp",
        "",
        f"- command: `{env.get('command')}`",
        machine_line(env),
        f"- threads: {env['threads']} (both sides); load average at end {env['load_average_end']} "
        "(per repetition in the tables)",
        f"- GGUF: `{Path(report['gguf']).name}`, both sides",
    ]
    for config, facts in report["kvcore"].items():
        lines.append(f"- kvcore `{config}` (prefix caching {'on' if facts['prefix_caching'] else 'off'}): "
                     f"{facts['kernels']}")
    if report.get("kvcore_options"):
        lines.append(f"- kvcore engine options beyond the defaults: {json.dumps(report['kvcore_options'])}")
    lines += [
        f"- llama.cpp: native llama-batched-bench ({lc['flags']}), commit {lc['build_commit']}, backends "
        f"{lc['backends']}, CPU info `{lc['cpu_info']}`",
        f"- {report['reps']} repetition(s) per point, alternating which side goes first; {report['seconds']:.0f} s",
        "",
    ]
    sides = _sides(report)
    kv_sides = [s for s in sides if s != "llama.cpp"]
    for kind, title in (("short", f"{plan['prompt_tokens']}-token prompts, one per request"),
                        ("long", "one shared long prompt (prefix cache / llama.cpp -pps)")):
        points = [p for p in report["points"] if p["kind"] == kind]
        if not points:
            continue
        lines += [f"## Aggregate decode tok/s, {title}", "",
                  "| requests | prompt | new each | rep | load avg | " + " | ".join(f"{s} tok/s" for s in sides)
                  + " | " + " | ".join(f"{s} / llama.cpp" for s in kv_sides) + " | "
                  + " | ".join(f"{s} TTFT" for s in sides) + " |",
                  "|" + "---|" * (5 + 2 * len(sides) + len(kv_sides))]
        for p in points:
            for r in p["runs"]:
                cells = [_num(r.get(s), "tok_s", "{:.1f}") for s in sides]
                ratios = [f"{r[s]['tok_s'] / r['llama.cpp']['tok_s']:.2f}x" if s in r and "llama.cpp" in r else "–"
                          for s in kv_sides]
                ttfts = [_num(r.get(s), "ttft_s", "{:.2f} s") for s in sides]
                lines.append(f"| {p['seqs']} | {p['prompt_tokens']} | {p['new_tokens']} | {r['rep'] + 1} | "
                             f"{r['load_average']} | " + " | ".join(cells + ratios + ttfts) + " |")
        lines.append("")
    return "\n".join(lines)


def _num(figures: dict[str, float] | None, key: str, fmt: str) -> str:
    return "–" if not figures or figures.get(key) is None else fmt.format(figures[key])


def _series(report: dict[str, Any], kind: str, side: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for p in report["points"]:
        values = [r[side]["tok_s"] for r in p["runs"] if side in r]
        if p["kind"] == kind and values:
            xs.append(p["seqs"])
            ys.append(statistics.median(values))
    return xs, ys


def plot_scale(report: dict[str, Any], path: Path) -> bool:
    """Two panels: aggregate decode tok/s against concurrent requests (short prompts), and at the long context."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    long_prompt = next((p["prompt_tokens"] for p in report["points"] if p["kind"] == "long"), None)
    titles = {"short": f"{report['plan']['prompt_tokens']}-token prompts",
              "long": f"{long_prompt}-token shared prompt"}
    for ax, kind in zip(axes, ("short", "long")):
        ticks: set[int] = set()
        for side in _sides(report):
            xs, ys = _series(report, kind, side)
            if xs:
                ax.plot(xs, ys, marker="o", linestyle="--" if side == "llama.cpp" else "-", label=side)
                ticks.update(xs)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate decode tok/s")
        ax.set_title(titles[kind])
        ax.grid(True, alpha=0.3)
        ax.legend()
    env = report["environment"]
    fig.suptitle(f"{Path(report['gguf']).name}, {env['threads']} threads, {env['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_scale(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "scale-curves.md", out_dir / "scale-curves.json"]
    paths[0].write_text(render_scale(report))
    paths[1].write_text(json.dumps(report, indent=2, default=str) + "\n")
    if plot_scale(report, out_dir / "scale-curves.png"):
        paths.append(out_dir / "scale-curves.png")
    return paths
