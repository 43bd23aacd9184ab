"""Is kvcore's default configuration as accurate as llama.cpp on the same quantized file?

Each runtime is compared with its own float32 model of the same GGUF (the file's blocks dequantized), on the same
text, chunks and scored positions, the way ``llama-perplexity --kl-divergence`` measures a quantization:

* llama.cpp: ``llama-quantize --allow-requantize FILE F32`` writes the float32 file; ``llama-perplexity
  --kl-divergence-base`` saves its log-probabilities, ``--kl-divergence`` runs the quantized file against them
  (llama.cpp's default CPU path: Q4_1 blocks dotted with Q8_1-quantized activations);
* kvcore: ``Engine.from_pretrained(FILE)`` with no settings (the default weights, dtype and LM head) against
  ``build_model`` of the dequantized weights in float32, both teacher-forced over the same chunks.

Chunks follow llama-perplexity: the text's tokens in chunks of ``--ctx``, the first token of each replaced by BOS
when the vocabulary adds one, the second half of each chunk scored (position ``j`` predicts token ``j + 1``).
Reported per runtime: mean KL divergence from its float32 model, top-1 agreement with it ("same top p"),
perplexity of both.

    python benchmarks/studies/accuracy_vs_llamacpp.py --models smollm2,GEMMA3_FILE --kvcore lm_head=dense \
        --text /usr/share/common-licenses/GFDL-1.3 --ctx 256

The default text (benchmarks/data/perplexity_text.txt) gives about 250 scored positions at ``--ctx 128``; Debian's
copy of the GNU FDL (5,000 tokens of English prose) gives ten times as many.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
from quant_accuracy import full_attention

from kvcore import Engine, EngineConfig
from kvcore.loaders import build_model, load_model
from kvcore.loaders.resolve import smollm2_path
from kvcore_bench.native_llamacpp import build_tools, dequantize_f32, kl_divergence
from kvcore_bench.real_size import cpu_summary

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "benchmarks" / "data" / "perplexity_text.txt"


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole ``ctx``-token slices, the first token replaced by BOS when one is added."""
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = ids[start:start + ctx]
        out.append(chunk if bos is None else [bos, *chunk[1:]])
    return out


def scored_logprobs(model, head, chunk: list[int]) -> torch.Tensor:
    """``[ctx - 1 - ctx // 2, V]`` float32 log-probabilities at the scored positions of one chunk (the LM head
    one row at a time, as decode steps run it)."""
    first = len(chunk) // 2
    windows = [model.config.layer_window(i) for i in range(model.config.num_hidden_layers)]
    with torch.no_grad():
        hidden = model(torch.tensor(chunk), torch.arange(len(chunk)), full_attention(windows))
        rows = hidden[first:len(chunk) - 1]
        return torch.cat([model.compute_logits(row, head) for row in rows.split(1)]).log_softmax(-1)


def kvcore_side(path: Path, text_ids: list[int], ctx: int, bos: int | None, settings: dict[str, str]) -> dict:
    """``settings``: EngineConfig fields changed from the default (none: the default configuration)."""
    engine = Engine.from_pretrained(str(path), EngineConfig(**settings))
    ref = build_model(load_model(str(path)), torch.float32, max_model_len=ctx)
    kls, same, nll_ref, nll = [], [], [], []
    for chunk in chunks(text_ids, ctx, bos):
        targets = torch.tensor(chunk[len(chunk) // 2 + 1:])
        ref_lp = scored_logprobs(ref, None, chunk)
        lp = scored_logprobs(engine.model, engine.lm_head, chunk)
        kls.append((ref_lp.exp() * (ref_lp - lp)).sum(-1))
        same.append(lp.argmax(-1) == ref_lp.argmax(-1))
        nll_ref.append(-ref_lp.gather(1, targets[:, None]).squeeze(1))
        nll.append(-lp.gather(1, targets[:, None]).squeeze(1))
    kl, agree = torch.cat(kls), torch.cat(same).float()
    config = engine.config
    return {"settings": " ".join(f"{k}={v}" for k, v in settings.items()) or "default",
            "mean_kld": float(kl.mean()), "mean_kld_err": float(kl.std() / kl.numel() ** 0.5),
            "same_top_p": float(agree.mean()), "ppl_base": float(torch.cat(nll_ref).mean().exp()),
            "ppl": float(torch.cat(nll).mean().exp()), "positions": kl.numel(),
            "configuration": f"dtype {config.dtype}, weights {engine.model.weight_format}, LM head {config.lm_head}, "
                             f"backend {config.backend}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2", help="comma-separated: smollm2 or GGUF files")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kvcore", action="append", default=None, metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="a kvcore configuration to measure besides the default (repeatable), e.g. lm_head=dense")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy-vs-llamacpp"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bin_dir = build_tools()
    rows = []
    for name in args.models.split(","):
        path = smollm2_path() if name == "smollm2" else Path(name)
        blocks = load_model(str(path), keep_quantized=True)
        tok = blocks.tokenizer
        text_ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))
        bos = tok.bos_token_id if tok.add_bos else None
        with tempfile.TemporaryDirectory() as tmp:
            f32 = dequantize_f32(bin_dir, path, Path(tmp) / "f32.gguf", args.threads)
            llama = kl_divergence(bin_dir, f32, path, Path(args.text), args.ctx, args.threads, Path(tmp))
        configs = [{}] + [dict(item.split("=", 1) for item in spec.split(",")) for spec in args.kvcore or []]
        kv = [kvcore_side(path, text_ids, args.ctx, bos, settings) for settings in configs]
        rows.append({"model": path.name, "text_tokens": len(text_ids), "llamacpp": llama, "kvcore": kv})
        print(json.dumps(rows[-1]), flush=True)
    report = {"command": "python benchmarks/studies/accuracy_vs_llamacpp.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "kvcore") and v != ap.get_default(k))
        + "".join(f" --kvcore {spec}" for spec in args.kvcore or []),
        "ctx": args.ctx, "text": _shown(Path(args.text)), "torch": torch.__version__,
        "cpu": cpu_summary(), "python": platform.python_version(), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def markdown(report: dict) -> str:
    cpu, isa = report["cpu"]
    lines = [
        "# Default accuracy against llama.cpp on the same file", "",
        f"Command: `{report['command'].strip()}` (torch {report['torch']}, {cpu}: {isa}).", "",
        "Each runtime against its own float32 model of the same GGUF (the blocks dequantized), teacher-forced on "
        f"{report['text']} in chunks of {report['ctx']} tokens, the second half of each chunk scored, "
        "as `llama-perplexity --kl-divergence` does. Lower KL and higher top-1 agreement are better.", "",
        "| model | runtime (configuration) | positions | mean KL vs own fp32 | top-1 agreement "
        "| PPL fp32 → quantized |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        runs = [("llama.cpp (CPU default)", r["llamacpp"])]
        runs += [(f"kvcore {m['settings']}: {m['configuration']}", m) for m in r["kvcore"]]
        for config, m in runs:
            lines.append(f"| {r['model']} | {config} | {m['positions']} | {m['mean_kld']:.5f} ± "
                         f"{m['mean_kld_err']:.5f} | {100 * m['same_top_p']:.1f}% | {m['ppl_base']:.3f} → "
                         f"{m['ppl']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
