"""Per-token cost of constrained decoding: median decode-step time at batch 8 with every row under a JSON
schema vs the same rows unconstrained (SmolLM2, fp32), steps alternated run by run.

    python benchmarks/studies/structured_overhead.py --steps 48 --reps 3
    python benchmarks/studies/structured_overhead.py --out benchmarks/results/structured-overhead.json

The end-to-end ratio is as noisy as the machine is busy; the grammar's own work (the batch bitmask, the
masking, feeding each token back) is also timed inside the constrained steps, and its share of an
unconstrained step is the overhead that does not depend on the neighbours' load.

The schema forces a long structured answer (at least 30 objects with a string, a bounded integer and an
enum array), so no constrained row finishes inside the measured steps. Prompts are chat-formatted requests
for that JSON; both modes decode greedily the same number of steps with all 8 rows running.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import kvcore.engine.forward
import kvcore.scheduling.outputs
from kvcore import Engine, EngineConfig, SamplingParams, StructuredOutput

SCHEMA = {
    "type": "array", "minItems": 30,
    "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
}
TOPICS = ["painters", "rivers", "cities", "chemists", "ships", "composers", "mountains", "poets"]


class GrammarClock:
    """Accumulates the wall time of the grammar's work inside engine steps (masking and accepting tokens)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = 0.0
        mask, accept = kvcore.engine.forward.apply_grammar_masks, kvcore.scheduling.outputs._refused

        def timed(fn):
            def run(*a, **kw):
                start = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - start
            return run

        kvcore.engine.forward.apply_grammar_masks = timed(mask)
        kvcore.scheduling.outputs._refused = timed(accept)


def decode_steps(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> list[float]:
    """Wall time of each of ``steps`` decode steps with all rows running (after their prefill)."""
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not engine._requests[r].output_ids for r in ids):  # prefill every row first
        engine.step()
    times = []
    for _ in range(steps):
        assert engine.gauges().num_running == len(prompts), "a row finished inside the measured steps"
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for r in ids:
        engine.abort(r)
        engine.release(r)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    engine = Engine.from_pretrained("smollm2", EngineConfig(backend=args.backend, max_num_seqs=args.batch,
                                                            max_model_len=512))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"List 30 famous {t} as JSON."}]),
                          add_bos=False) for t in (TOPICS * args.batch)[: args.batch]]
    free = SamplingParams(max_new_tokens=args.steps + 16, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=args.steps + 16, structured_output=StructuredOutput(json=SCHEMA))
    clock = GrammarClock(engine)
    decode_steps(engine, prompts, constrained, 4)  # warm-up: compiles the grammar, builds the lexer
    decode_steps(engine, prompts, free, 4)
    runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    clock.seconds = 0.0
    for rep in range(args.reps):  # ABBA order: a load that drifts during the run favours neither mode
        order = [("unconstrained", free), ("json_schema", constrained)]
        for name, params in order if rep % 2 == 0 else order[::-1]:
            runs[name] += decode_steps(engine, prompts, params, args.steps)
    med = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
    # grammar work per constrained step (prefill steps included in the clock: a slight overestimate)
    grammar_ms = clock.seconds * 1e3 / (args.reps * args.steps)
    result = {
        "batch": args.batch, "steps": args.steps, "reps": args.reps, "backend": args.backend,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "median_step_ms": med, "grammar_ms_per_step": grammar_ms,
        "end_to_end_overhead": med["json_schema"] / med["unconstrained"] - 1,
        "grammar_overhead": grammar_ms / med["unconstrained"],
    }
    print(f"batch {args.batch}, {args.steps} steps x {args.reps} reps, {torch.get_num_threads()} threads: "
          f"unconstrained {med['unconstrained']:.1f} ms/step, json_schema {med['json_schema']:.1f} ms/step "
          f"(end to end {result['end_to_end_overhead'] * 100:+.1f}%); grammar work {grammar_ms:.2f} ms/step = "
          f"{result['grammar_overhead'] * 100:.1f}% of an unconstrained step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
