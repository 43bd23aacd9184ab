"""Decode step time of the default engine with its GGUF token table read from the file per lookup (``pread`` of the
rows a step needs: the embedding row and the int4 head's 64 rescored candidates) against the same blocks held in
memory, alternating in one process (the table's blocks swapped between rounds), so that load hits both alike.
Also the table reads alone (one step's lookups), and the streams of both (the same token ids). Wall time and the
process's CPU time (``time.process_time``: on a shared machine it counts this process's work, not the waits; with
``--threads 1`` it is the step's work alone).

    python benchmarks/ab/embedding_file_ab.py [--threads 2] [--rounds 10] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams

PROMPT = "Tell me a story about a dragon."  # prose: most steps rescore a few rows no earlier step did


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=1024, max_num_seqs=1))
    table = engine.model.embedding
    if table is None or not table.blocks.in_file:
        raise SystemExit("the default here does not read its token table from the file")
    forms = {"file": table.blocks, "memory": table.blocks.resident()}

    streams = {}
    for name, blocks in forms.items():
        table.blocks = blocks
        streams[name] = engine.generate(PROMPT,
                                        SamplingParams(max_new_tokens=64, ignore_eos=True))[0].token_ids
    print(f"streams equal: {streams['file'] == streams['memory']}")

    engine.add_request(engine.tokenizer.encode(PROMPT), SamplingParams(max_new_tokens=900, ignore_eos=True))
    for _ in range(4):  # prefill and first decode steps
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in forms}
    cpu: dict[str, list[float]] = {name: [] for name in forms}
    reads: dict[str, list[float]] = {name: [] for name in forms}
    ids, candidates = torch.tensor([4000]), torch.randint(0, table.shape[0], (64,))
    for r in range(args.rounds):
        for name in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            table.blocks = forms[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu[name].append((time.process_time() - start_cpu) / args.steps * 1e3)
            start = time.process_time()
            for _ in range(args.steps * 10):
                table(ids), table[candidates]
            reads[name].append((time.process_time() - start) / (args.steps * 10) * 1e6)
    for name in forms:
        print(f"table in {name}: median {statistics.median(times[name]):.2f} ms per decode step, CPU "
              f"{statistics.median(cpu[name]):.2f} ms (rounds, wall: {' '.join(f'{t:.1f}' for t in times[name])}); "
              f"one step's table reads (1 + 64 rows) median CPU {statistics.median(reads[name]):.0f} us")


if __name__ == "__main__":
    main()
