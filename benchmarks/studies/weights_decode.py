"""Single-stream decode speed of SmolLM2-135M per weight format: float32, bfloat16, int4, int8.

One process builds one engine per format (sdpa backend, greedy, ``max_num_seqs=1``), warms each up, then runs
``--rounds`` rounds; every round generates ``--new-tokens`` tokens after the same ``--prompt-tokens``-token
prompt (the start of benchmarks/data/perplexity_text.txt) once per format, the order rotating from round to
round, so a noisy neighbour hits every format alike. Decode tok/s is the request's tokens after the first over
the time after the first (``RequestMetrics.tokens_per_s``); prefill is its time to first token. Reported:
medians over rounds, and each format's speed-up over float32 as the median of the per-round ratios.

    python benchmarks/studies/weights_decode.py              # writes benchmarks/results/weights.{md,json}
    python benchmarks/studies/weights_decode.py --rounds 3 --formats fp32,int4 --out /tmp/weights
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvcore.engine.core import Engine, EngineConfig
from kvcore.interfaces.sampler import SamplingParams
from kvcore.kernels.cpu import cpu_features
from kvcore.loaders import build_model, load_model

ROOT = Path(__file__).resolve().parents[2]
FORMATS = {"fp32": ("float32", "float"), "bf16": ("bfloat16", "float"), "int4": ("bfloat16", "int4"),
           "int8": ("bfloat16", "int8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weights"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    blocks = load_model("smollm2", keep_quantized=True)
    dense = load_model("smollm2")
    prompt = blocks.tokenizer.encode((ROOT / "benchmarks" / "data" / "perplexity_text.txt").read_text())
    prompt = prompt[: args.prompt_tokens]
    engines, sizes = {}, {}
    for name in names:
        dtype, weights = FORMATS[name]
        model = build_model(blocks if weights == "int4" else dense, getattr(torch, dtype), max_model_len=512,
                            weights=weights)
        engines[name] = Engine(model, None, EngineConfig(backend="sdpa", dtype=dtype, weights=weights,
                                                         max_num_seqs=1, max_model_len=512))
        engines[name].generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))  # builds packed copies
        sizes[name] = matmul_bytes(model)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            m = engines[name].generate([prompt], params)[0].metrics
            runs[name].append({"decode_tok_s": m.tokens_per_s, "prefill_s": m.ttft_s})
        print(f"round {r + 1}: " + ", ".join(f"{n} {runs[n][-1]['decode_tok_s']:.1f}" for n in names), flush=True)
        report = summary(args, ap, engines, sizes, runs, len(prompt), r + 1)
        out = Path(args.out)  # written after every round: a run cut short still leaves its complete rounds
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def summary(args, ap, engines, sizes, runs, prompt_tokens: int, rounds: int) -> dict:
    rows = []
    for name in runs:
        decode = [x["decode_tok_s"] for x in runs[name]]
        row = {"format": name, "dtype": FORMATS[name][0], "weights": engines[name].model.weight_format,
               "matmul_weight_mb": sizes[name] / 1e6, "decode_tok_s_median": statistics.median(decode),
               "decode_tok_s": decode, "prefill_s_median": statistics.median(x["prefill_s"] for x in runs[name])}
        if "fp32" in runs:
            ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs[name], runs["fp32"])]
            row["speedup_vs_fp32_median"] = statistics.median(ratios)
        rows.append(row)
    return {"command": "python benchmarks/studies/weights_decode.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v != ap.get_default(k)),
        "cpu": cpu_features().as_dict(), "torch": torch.__version__, "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens, "rounds": rounds, "rows": rows}


def matmul_bytes(model) -> int:
    """Bytes of the weights one decode step reads in matmuls (layers + LM head; oneDNN copies included once,
    as the step reads them instead of the parameters)."""
    total = 0
    for fns in model.matmuls(1).values():
        for fn in fns:
            packed = getattr(fn, "packed", None)
            total += packed.nbytes if isinstance(packed, torch.Tensor) else getattr(fn, "nbytes", 0)
    return total


def markdown(report: dict) -> str:
    cpu = report["cpu"]
    lines = [
        "# Weight formats: SmolLM2-135M single-stream decode", "",
        f"Command: `{report['command'].strip()}`", "",
        f"Machine: {cpu['model']}, torch {report['torch']} ({cpu['torch_capability']}; flags "
        f"{' '.join(cpu['flags'])}), {cpu['threads']} threads. Prompt {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens, greedy, sdpa backend, batch 1; {report['rounds']} rounds, formats "
        "alternating. The machine is shared with other jobs: single runs are noisy, the medians and the "
        "per-round ratios are what to read.", "",
        "| format | dtype | weights | matmul weights read per token | decode tok/s (median) | vs fp32 (median of "
        "per-round ratios) | prefill s (median) | all rounds, tok/s |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        ratio = f"{r['speedup_vs_fp32_median']:.2f}x" if "speedup_vs_fp32_median" in r else "-"
        lines.append(f"| {r['format']} | {r['dtype']} | {r['weights']} | {r['matmul_weight_mb']:.0f} MB | "
                     f"{r['decode_tok_s_median']:.1f} | {ratio} | {r['prefill_s_median']:.3f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['decode_tok_s'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
