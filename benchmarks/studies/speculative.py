"""Batch-1 decode speed with n-gram (or draft-model) speculation vs the same engine without, side by side.

    .venv/bin/python benchmarks/studies/speculative.py [--proposer ngram] [--k 8] [--reps 2] [--new 128] [--show] \
        [--engine-option weights='"float"'] [--option model='"smollm2"' ...]

The engine without speculation is kvcore's default (best) configuration for the embedded SmolLM2 GGUF (or that
with ``--engine-option`` EngineConfig fields, JSON values); the speculative one is that configuration plus
``proposer`` (its options from ``--option``, JSON values). Runs alternate (base, speculative, base, ...) so
a shared machine's load hits both alike. Decode speed is tokens after the first / time after the first;
CPU ms/token is this process's CPU time over the same tokens, which other processes' load disturbs far less
than wall time (with ``--threads 1`` it is the work done; with more threads it also counts threads waiting).
Prompts (benchmarks/studies/speculative_prompts.py): input-grounded (summarise, answer from, fix or edit a given text
or code) and free-form. ``--show`` prints each prompt's greedy answer (base and speculative side) and whether
the two streams are the same tokens (bfloat16: a verification's multi-row matmuls may round a near tie the
other way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from speculative_prompts import HELD_OUT, PROMPTS

from kvcore import Engine, EngineConfig, SamplingParams


def run(engine: Engine, prompt: str, new: int) -> dict:
    messages = [{"role": "user", "content": prompt}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=new))
    first = None  # (process CPU time, tokens) when the first token came
    while engine.has_unfinished():
        engine.step()
        if first is None and engine.result(rid).token_ids:
            first = (time.process_time(), len(engine.result(rid).token_ids))
    cpu_s = time.process_time() - first[0]
    out = engine.release(rid)
    m = out.metrics
    decoded = len(out.token_ids) - first[1]
    return {"prompt_tokens": len(ids), "tokens": len(out.token_ids), "tok_s": m.tokens_per_s,
            "cpu_ms_per_token": 1000 * cpu_s / decoded if decoded else None,
            "acceptance": m.acceptance_rate, "accepted_per_step": m.mean_accepted_length,
            "token_ids": list(out.token_ids), "text": out.text}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proposer", default="ngram")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="[proposers.NAME] option")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="EngineConfig field of both engines (JSON value), e.g. weights='\"float\"'")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help="names in speculative_prompts.PROMPTS or HELD_OUT")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--show", action="store_true", help="print each prompt's greedy answers")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    base = Engine.from_pretrained("smollm2", EngineConfig(**{k: json.loads(v) for k, v in
                                                             (o.split("=", 1) for o in args.engine_option)}))
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    config = dataclasses.replace(base.config, proposer=args.proposer, num_speculative_tokens=args.k,
                                 proposer_options={args.proposer: options})
    spec = Engine(base.model, base.tokenizer, config)
    print(f"base: {base.serving_config()}\nspeculative: proposer={args.proposer} k={args.k} {options}")
    print("load average (1, 5, 15 min):", " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    rows = []
    for engine in (base, spec):  # warm-up (allocations, first-use kernels, each engine's own KV cache and head)
        run(engine, PROMPTS["free-story"], 8)
    texts = {**PROMPTS, **HELD_OUT}
    for i, name in enumerate(args.prompts.split(",")):
        runs = {"base": [], "spec": []}
        for rep in range(args.reps):
            for side in ("base", "spec") if (i + rep) % 2 == 0 else ("spec", "base"):
                runs[side].append(run(base if side == "base" else spec, texts[name], args.new))
        b = statistics.median(r["tok_s"] for r in runs["base"])
        s = statistics.median(r["tok_s"] for r in runs["spec"])
        acc = runs["spec"][-1]["acceptance"]
        cpu_b = statistics.median(r["cpu_ms_per_token"] for r in runs["base"])
        cpu_s = statistics.median(r["cpu_ms_per_token"] for r in runs["spec"])
        row = {"prompt": name, "prompt_tokens": runs["base"][0]["prompt_tokens"],
               "tokens": runs["spec"][-1]["tokens"], "base_tok_s": b, "spec_tok_s": s, "speedup": s / b,
               "base_cpu_ms_per_token": cpu_b, "spec_cpu_ms_per_token": cpu_s, "cpu_speedup": cpu_b / cpu_s,
               "acceptance": acc, "accepted_per_step": runs["spec"][-1]["accepted_per_step"],
               "same_stream": runs["base"][0]["token_ids"] == runs["spec"][0]["token_ids"],
               "base_text": runs["base"][0]["text"], "spec_text": runs["spec"][0]["text"]}
        rows.append(row)
        acc_text = "-" if acc is None else f"{acc:.2f}"
        kept = row["accepted_per_step"]
        kept_text = "-" if kept is None else f"{kept:.2f}"
        print(f"{name:13s} prompt {row['prompt_tokens']:4d} tok  base {b:6.1f} tok/s  spec {s:6.1f} tok/s  "
              f"x{s / b:4.2f}  CPU ms/token {cpu_b:.1f} vs {cpu_s:.1f}: x{cpu_b / cpu_s:4.2f}  "
              f"acceptance {acc_text}  kept/verification {kept_text}  load {os.getloadavg()[0]:.1f}", flush=True)
        if args.show:
            same = "the same tokens" if row["same_stream"] else "a different stream: " + repr(row["spec_text"])
            print(f"  greedy answer: {row['base_text']!r}\n  speculative: {same}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
