"""Greedy streams of the 11 golden SmolLM2 prompts, eager against compiled decode steps (``compile=True``), in
one engine configuration; float32 also against the golden transformers streams.

    python benchmarks/studies/compiled_streams.py --dtype float32
    python benchmarks/studies/compiled_streams.py --dtype bfloat16 --weights int4 --lm-head int4
    python benchmarks/studies/compiled_streams.py --backend cpu_decode --dtype float32

Batches of up to 4 sequences (``max_num_seqs=4``), so the compiled code also meets several batch sizes and
ragged batches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvcore import Engine, EngineConfig, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="sdpa", help="a backend that declares compilable")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--lm-head", default="dense")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    golden = json.loads((ROOT / "tests" / "data" / "golden_smollm2.json").read_text())
    prompts = [p["prompt_token_ids"] for p in golden["prompts"]]
    params = SamplingParams(max_new_tokens=int(golden["max_new_tokens"]), ignore_eos=True)
    streams = {}
    for compiled in (False, True):
        config = EngineConfig(backend=args.backend, dtype=args.dtype, weights=args.weights, lm_head=args.lm_head,
                              max_model_len=512, max_num_seqs=4, compile=compiled)
        engine = Engine.from_pretrained("smollm2", config)
        streams[compiled] = [r.token_ids for r in engine.generate(prompts, params)]
    equal = sum(a == b for a, b in zip(streams[False], streams[True]))
    print(f"{vars(args)}: compiled streams equal to eager: {equal}/{len(prompts)} ({params.max_new_tokens} tokens)")
    if args.dtype == "float32":
        for compiled, label in ((False, "eager"), (True, "compiled")):
            gold = sum(s == p["token_ids"] for s, p in zip(streams[compiled], golden["prompts"]))
            print(f"{label} streams equal to the golden transformers streams: {gold}/{len(prompts)}")


if __name__ == "__main__":
    main()
