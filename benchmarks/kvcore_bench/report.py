"""The backend comparison's report: the targets judged, ``results.md``, ``results.json`` and the plot of
decode step time against context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcore_bench.common import median, pyplot
from kvcore_bench.settings import TARGET_BACKEND

__all__ = ["TARGETS", "evaluate_targets", "render_markdown", "render_target_table", "write_outputs"]

#: the performance targets: (key, description, comparison, threshold)
TARGETS = (
    ("decode", "decode tok/s, fp32, batch 1, 64-token context", ">=", 1.15),
    ("long", "decode tok/s, fp32, batch 1, 2048-token context", ">=", 1.5),
    ("bf16", "decode tok/s, bf16, batch 1", ">=", 1.6),
    ("batch", "aggregate decode tok/s, 8 concurrent ragged requests", ">=", 1.3),
    ("ttft", "time to first token, 2048-token prompt", "<=", 0.8),
    ("capacity", "concurrent sequences under a fixed KV budget: paged vs contiguous", ">=", 2.0),
    ("scaling", "decode step time at 4096 vs 64 context", "<=", 1.6),
    ("chunked", "worst inter-token gap (CPU time) while a 2048-token prompt is admitted: chunked vs whole", "<=",
     0.33),
)


def _find(measurements, case, side):
    return next((m for m in measurements if m.case == case and m.side == side), None)


def evaluate_targets(measurements, capacity, scaling, chunked=None) -> list[dict[str, Any]]:
    rows = []
    for key, label, op, threshold in TARGETS:
        row: dict[str, Any] = {"key": key, "case": label, "target": f"{'≥' if op == '>=' else '≤'} {threshold}×",
                               "kvcore": None, "reference": None, "ratio": None, "met": None}
        if key in ("decode", "long", "bf16", "batch", "ttft"):
            case = "long" if key == "ttft" else key
            ours, ref = _find(measurements, case, TARGET_BACKEND), _find(measurements, case, "transformers")
            if ours is not None and ref is not None:
                paired = ours.extra.get("paired_ttft_ratio" if key == "ttft" else "paired_decode_ratio")
                if key == "ttft":
                    row.update(kvcore=f"{ours.ttft_s:.2f} s", reference=f"{ref.ttft_s:.2f} s",
                               ratio=median(paired) if paired else ours.ttft_s / ref.ttft_s)
                elif ours.decode_tok_s and ref.decode_tok_s:
                    row.update(kvcore=f"{ours.decode_tok_s:.2f} tok/s", reference=f"{ref.decode_tok_s:.2f} tok/s",
                               ratio=median(paired) if paired else ours.decode_tok_s / ref.decode_tok_s)
                if paired:
                    row["paired_ratios"] = [round(r, 3) for r in paired]
        elif key == "capacity" and capacity:
            (c_label, c), (p_label, p) = capacity["caches"].items()
            row.update(kvcore=f"paged {p['max_concurrent']}", reference=f"{c_label} {c['max_concurrent']}",
                       ratio=capacity["ratio"])
        elif key == "scaling" and TARGET_BACKEND in scaling:
            series = scaling[TARGET_BACKEND]
            if 64 in series and 4096 in series:
                row.update(kvcore=f"{series[4096] * 1e3:.1f} ms @4096", reference=f"{series[64] * 1e3:.1f} ms @64",
                           ratio=series[4096] / series[64])
        elif key == "chunked" and chunked:
            c, w = chunked["modes"]["chunked"], chunked["modes"]["whole"]
            row.update(kvcore=f"chunked {c['worst_gap_cpu_s']:.2f} CPU s",
                       reference=f"whole {w['worst_gap_cpu_s']:.2f} CPU s", ratio=chunked["ratio"])
        if row["ratio"] is not None:
            row["met"] = row["ratio"] >= threshold if op == ">=" else row["ratio"] <= threshold
        rows.append(row)
    return rows


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def render_target_table(report: dict[str, Any]) -> str:
    lines = [
        f"| case | kvcore ({TARGET_BACKEND}) | reference | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["targets"]:
        met = "–" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['case']} | {row['kvcore'] or '–'} | {row['reference'] or '–'} | "
                     f"{_fmt(row['ratio'], '.2f', '×')} | {row['target']} | {met} |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    env, s = report["environment"], report["settings"]
    out = [
        "# kvcore bench",
        "",
        f"Command: `{env.get('command', 'kvcore bench')}`  ",
        f"Model: {s['model']}; torch {env.get('torch')} ({env.get('threads')} threads); "
        f"transformers {env.get('transformers') or 'not used'}; CPU: {env.get('cpu')}; "
        f"load average at start {env.get('load_average')}, at end {env.get('load_average_end')}; "
        f"{env.get('elapsed_s')} s in all.",
        "",
        "## Targets",
        "",
        f"Ratios are kvcore's `{TARGET_BACKEND}` backend (the engine's default on CPU) against transformers "
        "(sdpa) on the same weights and dtype, in one process: the two run back to back in every repetition "
        "and the ratio is the median of the per-repetition ratios (the kvcore / reference columns are "
        "medians of each side). Capacity and scaling come from the engine alone.",
        "",
        render_target_table(report),
        "",
        "## Per backend",
        "",
        "| case | side | runs | TTFT | TPOT | decode tok/s | peak RSS | KV allocated | KV peak in use "
        "| same tokens as transformers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["measurements"]:
        same = "–" if m["tokens_match_transformers"] is None else ("yes" if m["tokens_match_transformers"] else "no")
        out.append(
            f"| {m['case']} | {m['side']} | {m['runs']} | {_fmt(m['ttft_s'], '.3f', ' s')} | "
            f"{_fmt(m['tpot_s'] and m['tpot_s'] * 1e3, '.1f', ' ms')} | {_fmt(m['decode_tok_s'])} | "
            f"{_fmt(m['peak_rss_mib'], '.0f', ' MiB')} | {_fmt(_mib(m['kv_bytes_allocated']), '.1f', ' MiB')} | "
            f"{_fmt(_mib(m['kv_bytes_peak']), '.1f', ' MiB')} | {same} |"
        )
    cap = report.get("capacity")
    if cap:
        out += [
            "",
            "## Capacity under a fixed KV budget",
            "",
            f"Budget {_mib(cap['kv_budget_bytes']):.1f} MiB (= 4 contiguous slots of max_model_len "
            f"{cap['max_model_len']}); {cap['requests']} requests, prompts {min(cap['prompt_lengths'])}–"
            f"{max(cap['prompt_lengths'])} tokens, {cap['new_tokens']} new tokens each, submitted together.",
            "",
            "| cache | KV allocated | max concurrent | mean concurrent | steps | preemptions | peak KV in use | "
            "wall | generated tok/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, c in cap["caches"].items():
            out.append(
                f"| {label} | {_mib(c['kv_bytes_allocated']):.1f} MiB | {c['max_concurrent']} | "
                f"{c['mean_concurrent']} | {c['steps']} | {c['preemptions']} | "
                f"{_mib(c['kv_bytes_peak_in_use']):.1f} MiB | {c['wall_s']} s | {c['generated_tok_s']} |"
            )
    if report.get("scaling"):
        sides = list(report["scaling"])
        contexts = sorted({int(c) for d in report["scaling"].values() for c in d})
        out += ["", "## Decode step time vs context (ms, batch 1, fp32)", "",
                "| context | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
        for ctx in contexts:
            cells = [_fmt(report["scaling"][side].get(str(ctx)) and report["scaling"][side][str(ctx)] * 1e3, ".1f")
                     for side in sides]
            out.append(f"| {ctx} | " + " | ".join(cells) + " |")
        ratios = []
        for side in sides:
            d = report["scaling"][side]
            if "64" in d and "4096" in d:
                ratios.append(f"{side} {d['4096'] / d['64']:.2f}×")
        if ratios:
            out += ["", "4096 vs 64: " + ", ".join(ratios)]
    ch = report.get("chunked")
    if ch:
        out += ["", "## Chunked prefill", "",
                f"4 requests decoding on `{ch['backend']}` when a {ch['prompt_tokens']}-token prompt arrives; "
                f"chunked: {ch['budget']} tokens per step. Gaps are between a running request's tokens, "
                "from the prompt's arrival to its first token; the target is judged on the process's CPU time "
                f"(wall-clock ratio {ch['ratio_wall']:.2f}×).", "",
                "| prefill | worst gap (CPU) | worst gap (wall) | median gap (wall) | long prompt TTFT |",
                "|---|---|---|---|---|"]
        for label, m in ch["modes"].items():
            out.append(f"| {label} | {m['worst_gap_cpu_s']:.2f} s | {m['worst_gap_s']:.3f} s | "
                       f"{m['median_gap_s']:.3f} s | {m['long_ttft_s']:.3f} s |")
    sp = report.get("speculative")
    if sp:
        b, g = sp["modes"]["base"], sp["modes"]["ngram"]
        out += ["", "## Speculative decoding", "",
                f"Batch 1 on `{sp['backend']}`, a {sp['prompt_tokens']}-token input-grounded prompt, "
                f"{sp['new_tokens']} new tokens: n-gram speculation {g['decode_tok_s']:.1f} tok/s vs "
                f"{b['decode_tok_s']:.1f} tok/s without ({sp['speedup']:.2f}×); acceptance rate "
                f"{g['acceptance_rate']:.2f}, {g['mean_accepted_length']:.2f} drafts kept per verification, "
                f"{g['tokens_per_step']:.2f} tokens per decode step."]
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


def _mib(value):
    return None if value is None else value / 2**20


def plot_scaling(scaling: dict[str, dict[Any, float]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, series in scaling.items():
        xs = sorted(int(c) for c in series)
        ax.plot(xs, [series[c if c in series else str(c)] * 1e3 for c in xs], marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title("SmolLM2-135M decode step, batch 1, fp32")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.md", out_dir / "results.json"]
    paths[0].write_text(render_markdown(report))
    paths[1].write_text(json.dumps(report, indent=2, default=str) + "\n")
    if report.get("scaling"):
        png = out_dir / "decode_step_vs_context.png"
        if plot_scaling(report["scaling"], png):
            paths.append(png)
    return paths

