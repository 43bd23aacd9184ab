"""The ``ngram`` proposer's settings compared by replaying recorded greedy streams: one plain greedy run per prompt
(batch 1, the default configuration of the embedded SmolLM2 GGUF), then every setting replayed on those streams
in milliseconds, with no machine load in the figures.

    .venv/bin/python benchmarks/studies/speculative_replay.py [--set main|held-out|both] [--new 64,128] \\
        [--draft-cost 0.12,0.16,0.22] [--setting max_n=3,misses=3,cooldown=2 ...] [--first-drafts 8,4] \\
        [--streams FILE.json]

Greedy streams are the same with speculation on and off (docs/speculative.md), so the tokens a proposer sees and
the drafts the model keeps are fixed by the stream: the replay asks the proposer for drafts at each position
(the engine's budget: at most ``K``, never past the stream's end), keeps the longest prefix that matches the
stream, reports the verification to the proposer, and moves on by kept + 1 tokens (``--first-drafts``: with
that many drafts in a request's first proposal, ``kvcore.speculative.backoff.FIRST_DRAFTS``). The modelled speed-up is
tokens / cost, a verification of ``k`` drafts costing ``1 + draft_cost * k`` plain steps and every other token
one (speculative_trace.py uses the same model on the engine's own run; benchmarks/studies/verify_cost.py measures
``draft_cost``). ``--set held-out`` replays prompts no setting was chosen on (speculative_prompts.HELD_OUT).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

from speculative_prompts import GROUNDED, HELD_OUT, HELD_OUT_GROUNDED, PROMPTS

from kvcore import Engine, SamplingParams
from kvcore.sampling.rejection import num_matching
from kvcore.speculative import backoff
from kvcore.speculative.ngram import NgramProposer

#: the settings compared when none are given: the defaults, and the previous defaults
SETTINGS = ("", "max_n=4,misses=2,cooldown=16")


def record(names: dict[str, str], new: int) -> dict[str, tuple[list[int], list[int]]]:
    """Each prompt's token ids and its greedy answer of up to ``new`` tokens."""
    engine, streams = Engine.from_pretrained("smollm2"), {}
    tok = engine.tokenizer
    for name, text in names.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        streams[name] = (ids, list(engine.generate([ids], SamplingParams(max_new_tokens=new))[0].token_ids))
    return streams


def replay(prompt: list[int], out: list[int], proposer: NgramProposer, k: int, draft_cost: float) -> float:
    """The modelled speed-up of ``proposer`` on one recorded stream (its first token comes from the prefill)."""
    proposer.start("r", prompt)
    t, cost = 1, 1.0
    while t < len(out):
        budget = min(k, len(out) - t - 1)
        row = SimpleNamespace(request_id="r", prompt_ids=prompt, output_ids=out[:t])
        drafts = proposer.propose([row], [budget])[0].token_ids if budget > 0 else []
        kept = num_matching(drafts, out[t:])
        if drafts:
            proposer.advance("r", len(drafts), kept)
        cost += 1 + draft_cost * len(drafts)
        t += kept + 1
    proposer.finish("r")
    return len(out) / cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("main", "held-out", "both"), default="both")
    ap.add_argument("--new", default="64,128", help="answer lengths replayed (each a prefix of the longest)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--draft-cost", default="0.16", help="comma-separated costs of a draft row, in plain steps")
    ap.add_argument("--setting", action="append", default=None, metavar="KEY=VALUE,...",
                    help="[proposers.ngram] options to compare (repeatable; '' = the defaults)")
    ap.add_argument("--first-drafts", default=str(backoff.FIRST_DRAFTS),
                    help="comma-separated drafts of a request's first proposal (backoff.FIRST_DRAFTS)")
    ap.add_argument("--streams", default=None, help="JSON file of recorded streams: read if present, else written")
    args = ap.parse_args()
    lengths = [int(n) for n in args.new.split(",")]
    prompts = {"main": PROMPTS, "held-out": HELD_OUT, "both": {**PROMPTS, **HELD_OUT}}[args.set]
    cache = Path(args.streams) if args.streams else None
    if cache is not None and cache.is_file():
        streams = {k: tuple(v) for k, v in json.loads(cache.read_text()).items() if k in prompts}
    else:
        streams = record(prompts, max(lengths))
        if cache is not None:
            cache.write_text(json.dumps(streams))
    grounded = [n for n in streams if n in GROUNDED or n in HELD_OUT_GROUNDED]
    free = [n for n in streams if n not in grounded]
    for setting in args.setting or SETTINGS:
        options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in setting.split(",") if kv)}
        for first in (int(f) for f in args.first_drafts.split(",")):
            backoff.FIRST_DRAFTS = first
            for cost in (float(c) for c in args.draft_cost.split(",")):
                for new in lengths:
                    got = {n: replay(p, o[:new], NgramProposer(**options), args.k, cost)
                           for n, (p, o) in streams.items()}
                    mean = math.exp(sum(math.log(got[n]) for n in grounded) / len(grounded))
                    cells = " ".join(f"{n}={got[n]:.2f}" for n in streams)
                    print(f"{setting or 'defaults':24s} first {first} cost {cost:.2f} new {new:3d}: grounded geomean "
                          f"{mean:.3f} (min {min(got[n] for n in grounded):.2f}), free-form min "
                          f"{min(got[n] for n in free):.2f} | {cells}", flush=True)


if __name__ == "__main__":
    main()
