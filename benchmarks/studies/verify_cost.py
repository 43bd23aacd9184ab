"""What a verification step costs against a plain decode step, by number of drafts (batch 1, SmolLM2 GGUF, the
default configuration: ``cpu_decode``, bfloat16, ``int4a8``): the price of each draft row, which a proposer's
draft length has to earn back.

    .venv/bin/python benchmarks/studies/verify_cost.py [--ks 0,1,2,4,8,12,15] [--steps 24] [--context 600] [--threads 1]

Each ``K`` is an engine whose proposer always proposes ``K`` drafts that the model rejects (so every step is
a verification of ``K + 1`` rows and emits one token, and the KV cache goes back each step); ``K = 0`` is the
same engine without speculation. Engines alternate in rounds of ``--steps`` steps, so a shared machine's load
hits them alike. Reported per K: median wall ms and median process CPU ms per step, and their ratio to K = 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from kvcore import Engine, SamplingParams, hookimpl
from kvcore.interfaces.proposer import Proposal, Proposer
from kvcore.plugins.registry import get_registry


class WrongDrafts(Proposer):
    """``K`` drafts that are never kept: the token after the last one plus one (the model's pick is checked)."""

    name = "bench-wrong-drafts"

    def propose(self, rows, num_tokens):
        return [Proposal([(r.output_ids[-1] + 7 + i) % 49152 for i in range(k)]) for r, k in zip(rows, num_tokens)]


class Plugin:
    @hookimpl
    def kvcore_register_proposers(self, register):
        register(WrongDrafts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="0,1,2,4,8,12,15")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    get_registry().register_plugin(Plugin(), name="bench-wrong-drafts")
    base = Engine.from_pretrained("smollm2")
    ks = [int(k) for k in args.ks.split(",")]
    engines, rids = {}, {}
    prompt = [(37 * i) % 40000 + 100 for i in range(args.context)]
    total = args.rounds * args.steps + 4
    for k in ks:
        engines[k] = base if k == 0 else Engine(base.model, base.tokenizer, dataclasses.replace(
            base.config, proposer=WrongDrafts.name, num_speculative_tokens=k))
        rids[k] = engines[k].add_request(prompt, SamplingParams(max_new_tokens=total, ignore_eos=True))
        for _ in range(3):  # prefill, warm-up
            engines[k].step()
    wall = {k: [] for k in ks}
    cpu = {k: [] for k in ks}
    print(f"load average before: {os.getloadavg()[0]:.1f}; {args.threads} thread(s), context {args.context}")
    for r in range(args.rounds):
        for k in ks if r % 2 == 0 else ks[::-1]:
            for _ in range(args.steps):
                w, c = time.perf_counter(), time.process_time()
                engines[k].step()
                wall[k].append(time.perf_counter() - w)
                cpu[k].append(time.process_time() - c)
    for k in ks:
        m = engines[k].result(rids[k]).metrics
        assert k == 0 or m.num_draft_tokens > 0 == m.num_accepted_tokens, "every draft verified and rejected"
    w0, c0 = statistics.median(wall[0]), statistics.median(cpu[0])
    print("| drafts K | rows verified | wall ms/step | × K=0 | CPU ms/step | × K=0 |\n|---|---|---|---|---|---|")
    for k in ks:
        w, c = statistics.median(wall[k]), statistics.median(cpu[k])
        print(f"| {k} | {k + 1} | {1e3 * w:.2f} | {w / w0:.2f} | {1e3 * c:.2f} | {c / c0:.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
