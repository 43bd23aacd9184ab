"""What a proposer proposes and what the model keeps, verification by verification (batch 1, greedy, the default
configuration of the embedded SmolLM2 GGUF), with a modelled speed-up that machine load does not move.

    .venv/bin/python benchmarks/studies/speculative_trace.py [--prompts summarise,fix-typos] [--k 8] [--new 64] \\
        [--option min_n=3] [--draft-cost 0.15] [--show]

Greedy streams are the same with speculation on and off (docs/speculative.md), so a run's proposals and kept
drafts are the same every time: the modelled speed-up is tokens / cost, where a verification of ``k`` drafts
costs ``1 + draft_cost * k`` plain steps (benchmarks/studies/verify_cost.py measures ``draft_cost``) and every other
token one plain step. The ceiling is the same modelled speed-up for the same lookup (the latest occurrence of the
longest n-gram) with a draft count that knows how many drafts will be kept: no verification where none would
be, and only the kept ones otherwise; what no draft-count policy of this lookup can exceed. ``--show`` prints
each verification: position in the output, the proposal's source
position in the request's tokens, drafts kept, the drafts and what the model wrote there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from speculative_prompts import PROMPTS

from kvcore import Engine, SamplingParams


def ceiling(prompt: list[int], out: list[int], k: int, max_n: int, min_n: int, draft_cost: float) -> float:
    """Modelled speed-up of prompt lookup with an oracle draft count (the first token comes from the prefill)."""
    t, cost = 1, 1.0
    while t < len(out):
        tokens, start = prompt + out[:t], None
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            tail = tokens[-n:]
            start = next((s for s in range(len(tokens) - 1, n - 1, -1) if tokens[s - n : s] == tail), None)
            if start is not None:
                break
        kept = 0
        if start is not None:
            while kept < min(k, len(out) - t - 1, len(tokens) - start) and tokens[start + kept] == out[t + kept]:
                kept += 1
        cost += 1 + draft_cost * kept if kept else 1
        t += kept + 1
    return len(out) / cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="[proposers.ngram] option")
    ap.add_argument("--draft-cost", type=float, default=0.15, help="a draft row's cost in plain decode steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = Engine.from_pretrained("smollm2")
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    engine = Engine(base.model, base.tokenizer, dataclasses.replace(
        base.config, proposer="ngram", num_speculative_tokens=args.k, proposer_options={"ngram": options}))
    proposer, log = engine.speculator.proposer, []
    propose, advance = proposer.propose, proposer.advance

    def traced_propose(rows, num_tokens):
        out = propose(rows, num_tokens)
        source = proposer._states[rows[0].request_id].source
        log.append([len(rows[0].output_ids), out[0].token_ids, source, 0])
        return out

    def traced_advance(request_id, num_proposed, num_accepted):
        log[-1][3] = num_accepted
        advance(request_id, num_proposed, num_accepted)

    proposer.propose, proposer.advance = traced_propose, traced_advance
    tok = engine.tokenizer
    print(f"K = {args.k}, ngram options {options}, a draft row costs {args.draft_cost} of a plain step")
    for name in args.prompts.split(","):
        log.clear()
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}],
                                                 add_generation_prompt=True))
        out = engine.generate([ids], SamplingParams(max_new_tokens=args.new))[0]
        verified = [(len(drafts), kept) for _, drafts, _, kept in log if drafts]
        cost = sum(1 + args.draft_cost * k for k, _ in verified)
        # every other token is a plain step; a stream that ends inside a verification emits only up to its end
        emitted = sum(min(kept + 1, len(out.token_ids) - at) for at, drafts, _, kept in log if drafts)
        cost += len(out.token_ids) - emitted
        drafts = sum(k for k, _ in verified)
        kept = sum(a for _, a in verified)
        best = ceiling(list(ids), list(out.token_ids), args.k, proposer.max_n, proposer.min_n, args.draft_cost)
        print(f"{name:13s} {len(ids):4d} prompt tokens  {len(out.token_ids):3d} tokens  {len(verified):2d} "
              f"verifications  acceptance {kept / drafts if drafts else 0:.2f}  "
              f"modelled speed-up {len(out.token_ids) / cost:.2f}  ceiling {best:.2f}", flush=True)
        if args.show:
            print(f"  answer: {out.text!r}")
            for at, proposal, source, num_kept in log:
                if proposal:
                    wrote = out.token_ids[at : at + len(proposal) + 1]
                    print(f"  @{at:3d} source {source} kept {num_kept}/{len(proposal)}: "
                          f"{tok.decode(proposal)!r} / {tok.decode(wrote)!r}")


if __name__ == "__main__":
    main()
