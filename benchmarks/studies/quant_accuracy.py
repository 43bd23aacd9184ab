"""How much each weight format changes SmolLM2-135M's output, against the float32 model of the same GGUF
(its Q4_1 / Q8_0 weights dequantized: the path that equals transformers token for token).

Per format (bfloat16 activations for all but the reference):

* greedy streams on the golden prompts (tests/data/golden_smollm2.json, 48 tokens each, sdpa backend): the
  first step where the stream leaves the float32 one, and whether that step is a near-tie: the float32
  top-2 logit gap there is within the format's typical logit error (the median over the perplexity text's
  positions of the largest |logit - float32 logit|, teacher-forced);
* on benchmarks/data/perplexity_text.txt (public-domain prose: the Gettysburg Address, Bliss copy, and the
  first two paragraphs of Dickens's *A Tale of Two Cities*; 544 tokens): perplexity, mean KL divergence from
  the float32 next-token distribution, top-1 agreement, and that logit error (max and median per position).

    python benchmarks/studies/quant_accuracy.py                 # writes benchmarks/results/quant_accuracy.{md,json}
    python benchmarks/studies/quant_accuracy.py --formats int4 --out /tmp/acc
    python benchmarks/studies/quant_accuracy.py --model /work/models/gemma3/gemma-3-270m-q4_k_m.gguf \
        --formats bf16,gguf,gguf+head --out benchmarks/results/quant_accuracy-gemma3

Another ``--model`` (a GGUF file) runs the golden prompts' texts through its own tokenizer.

Formats: ``bf16`` (dense bfloat16), ``int4`` (the file's Q4_1 blocks as stored, ``weights="auto"``), ``int4a8``
(the same blocks with int8 activations in every matmul; ``+head``: with the int4 LM head), ``int8``
(per-channel, re-quantized from the dequantized weights), ``int4-g128`` (re-quantized in groups of 128),
``gguf`` (a K-quant file's blocks as stored; ``+head``: with the int4 LM head, the default on such a file).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcore.engine.core import Engine, EngineConfig
from kvcore.interfaces.sampler import SamplingParams
from kvcore.kernels.cpu import cpu_features
from kvcore.loaders import build_model, load_model
from kvcore.model.embedding import head_rows
from kvcore.model.lm_head import RescoredInt4Head

ROOT = Path(__file__).resolve().parents[2]
FORMATS = {  # name -> (dtype, weights, group size, LM head)
    "bf16": (torch.bfloat16, "float", 32, "dense"),
    "int4": (torch.bfloat16, "auto", 32, "dense"),
    "int4+head": (torch.bfloat16, "auto", 32, "int4"),
    "int4a8": (torch.bfloat16, "int4a8", 32, "dense"),
    "int4a8+head": (torch.bfloat16, "int4a8", 32, "int4"),
    "int8": (torch.bfloat16, "int8", 32, "dense"),
    "int4-g128": (torch.bfloat16, "int4-requantized", 128, "dense"),
    "gguf": (torch.bfloat16, "gguf", 32, "dense"),
    "gguf+head": (torch.bfloat16, "gguf", 32, "int4"),
}


def full_attention(windows: list[int | None]):
    """Causal attention over the whole call (one sequence, no cache), each layer within its sliding window (a
    query sees the ``window`` latest positions, itself included): the teacher-forced reference pass."""

    def attend(layer, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        pos = torch.arange(q.shape[0])
        mask = pos[None, :] <= pos[:, None]
        if windows[layer] is not None:
            mask &= pos[:, None] - pos[None, :] < windows[layer]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1)

    return attend


def text_logits(model, ids: list[int], lm_head: str = "dense") -> torch.Tensor:
    """``[T, V]`` float32 logits of every position of ``ids`` in one forward (the head one row at a time, as
    decode steps run it)."""
    a8 = model.weight_format in ("int4a8", "gguf")  # as the engine builds it: int4a8 weights score with their kernel
    head = RescoredInt4Head(head_rows(model), a8=a8) if lm_head == "int4" else None
    with torch.no_grad():
        windows = [model.config.layer_window(i) for i in range(model.config.num_hidden_layers)]
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), full_attention(windows))
        return torch.cat([model.compute_logits(row, head) for row in hidden.split(1)])


def streams(model, dtype, prompts: list[list[int]], new_tokens: int,
            lm_head: str = "dense") -> tuple[list[list[int]], list[list[float]]]:
    """Greedy streams (sdpa backend, one sequence per step: the LM head runs as a batch-1 decode runs it) and
    each step's top-2 logprob gap (= the top-2 logit gap)."""
    engine = Engine(model, None, EngineConfig(backend="sdpa", dtype=str(dtype).removeprefix("torch."),
                                              max_model_len=256, max_num_seqs=1, lm_head=lm_head))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=2)
    results = engine.generate(prompts, params)
    gaps = [[step[0][1] - step[1][1] for step in r.top_logprobs] for r in results]  # [(token, logprob)] best first
    return [r.token_ids for r in results], gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the golden streams' model) or a GGUF file")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_accuracy"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    golden = json.loads((ROOT / "tests" / "data" / "golden_smollm2.json").read_text())
    new_tokens = int(golden["max_new_tokens"])
    blocks = load_model(args.model, keep_quantized=True)
    is_golden = args.model == "smollm2"
    prompts = [p["prompt_token_ids"] if is_golden else blocks.tokenizer.encode(p["prompt"]) for p in golden["prompts"]]
    text = (ROOT / "benchmarks" / "data" / "perplexity_text.txt").read_text(encoding="utf-8")
    text_ids = blocks.tokenizer.encode(text)

    dense = load_model(args.model)
    ref = build_model(dense, torch.float32, max_model_len=1024)
    ref_tokens, ref_gaps = streams(ref, torch.float32, prompts, new_tokens)
    golden_equal = sum(t == p["token_ids"] for t, p in zip(ref_tokens, golden["prompts"])) if is_golden else None
    ref_logits = text_logits(ref, text_ids)
    ref_logp = ref_logits.log_softmax(-1)
    targets = torch.tensor(text_ids[1:])

    def perplexity(logits: torch.Tensor) -> float:
        return float(torch.exp(F.cross_entropy(logits[:-1], targets)))

    rows = [{"format": "fp32 (reference)", "weights": "float", "dtype": "float32", "perplexity": perplexity(ref_logits),
             "streams_equal": len(prompts), "near_ties": 0, "real_divergences": 0, "divergences": []}]
    for name in args.formats.split(","):
        dtype, weights, group, lm_head = FORMATS[name]
        started = time.perf_counter()
        if weights == "int4-requantized":  # from the dequantized float weights, not the file's blocks
            model = build_model(dense, dtype, max_model_len=1024, weights="int4", group_size=group)
        else:
            model = build_model(blocks if weights in ("auto", "int4a8", "gguf") else dense, dtype, max_model_len=1024,
                                weights=weights)
        logits = text_logits(model, text_ids, lm_head)
        err = (logits - ref_logits).abs().amax(-1)  # per position: the largest logit error
        logp = logits.log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        tokens, _ = streams(model, dtype, prompts, new_tokens, lm_head)
        divergences = []
        for i, (a, b) in enumerate(zip(ref_tokens, tokens)):
            step = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if step is not None:
                gap = ref_gaps[i][step]
                divergences.append({"prompt": golden["prompts"][i]["name"], "step": step, "fp32_top2_gap": gap,
                                    "near_tie": gap <= float(err.median())})
        ties = sum(d["near_tie"] for d in divergences)
        rows.append({
            "format": name, "weights": model.weight_format, "lm_head": lm_head,
            "dtype": str(dtype).removeprefix("torch."),
            "group_size": group if model.weight_format == "int4" else None,
            "perplexity": perplexity(logits), "mean_kl": float(kl[:-1].mean()),
            "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "logit_err_max": float(err.max()), "logit_err_median": float(err.median()),
            "streams_equal": len(prompts) - len(divergences), "near_ties": ties,
            "real_divergences": len(divergences) - ties, "divergences": divergences,
            "seconds": time.perf_counter() - started,
        })
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "divergences"}), flush=True)
        del model
    report = {
        "command": "python benchmarks/studies/quant_accuracy.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "out" and v != ap.get_default(k)),
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF)" if is_golden else Path(args.model).name,
        "prompts": len(prompts), "new_tokens": new_tokens,
        "fp32_streams_equal_golden": golden_equal, "text_tokens": len(text_ids), "torch": torch.__version__,
        "cpu": cpu_features().as_dict(), "python": platform.python_version(), "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _title(model: str) -> str:
    """``"SmolLM2-135M-Instruct"`` of ``"smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF)"``; a file's name as it is."""
    return model[model.index("(") + 1:].split(" ")[0] if "(" in model else model


def markdown(report: dict) -> str:
    golden = report["fp32_streams_equal_golden"]
    lines = [
        f"# Weight formats: accuracy on {_title(report['model'])}", "",
        f"Command: `{report['command'].strip()}` (torch {report['torch']}, {report['cpu']['model']}).", "",
        "Reference: the float32 model of the same GGUF (dequantized weights)"
        + (f"; its greedy streams equal the golden transformers streams on {golden}/{report['prompts']} prompts"
           if golden is not None else "") + ". Streams: "
        f"{report['prompts']} golden prompts x {report['new_tokens']} tokens, sdpa backend. A divergence is a "
        "near-tie when the float32 top-2 logit gap at that step is within the format's median logit error on the "
        "text (per position, the largest |logit - float32 logit| over the vocabulary). Text: "
        f"benchmarks/data/perplexity_text.txt ({report['text_tokens']} tokens), teacher-forced.", "",
        "| format | weights | perplexity | mean KL vs fp32 | top-1 agreement | logit error max / median "
        "| streams equal | diverge at near-tie | diverge otherwise |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        err = f"{r['logit_err_max']:.3f} / {r['logit_err_median']:.3f}" if "logit_err_max" in r else "-"
        kl = f"{r['mean_kl']:.5f}" if "mean_kl" in r else "-"
        agree = f"{100 * r['top1_agreement']:.1f}%" if "top1_agreement" in r else "-"
        weights = r["weights"] + (f" (g{r['group_size']})" if r.get("group_size") else "")
        weights += ", LM head int4 (top 64 rescored)" if r.get("lm_head") == "int4" else ""
        lines.append(f"| {r['format']} | {weights} | {r['perplexity']:.3f} | {kl} | {agree} | {err} | "
                     f"{r['streams_equal']} | {r['near_ties']} | {r['real_divergences']} |")
    lines += ["", "Divergences (prompt, step, float32 top-2 gap there):", ""]
    for r in report["rows"]:
        for d in r["divergences"]:
            lines.append(f"- {r['format']}: {d['prompt']} at step {d['step']}, gap {d['fp32_top2_gap']:.3f}"
                         f" ({'near-tie' if d['near_tie'] else 'not a near-tie'})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
