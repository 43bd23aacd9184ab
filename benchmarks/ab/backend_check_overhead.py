"""Cost of the backend-boundary check (kvcore/execution/backend_check.py) on decode steps.

One engine decodes one request; blocks of steps alternate between the check on (the engine's guards) and
off, so machine load drifts over both alike. Reports the median step time of each (wall and process CPU
time) and the difference. Run from the repository root:

    python benchmarks/ab/backend_check_overhead.py --model smollm2 --backend sdpa --rounds 12 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcore import Engine, EngineConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--rounds", type=int, default=12, help="blocks of steps per setting")
    p.add_argument("--steps", type=int, default=16, help="decode steps per block")
    p.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    max_new = 2 * args.rounds * args.steps + 8
    engine = Engine.from_pretrained(args.model, EngineConfig(backend=args.backend, dtype="float32", max_num_seqs=1,
                                                             max_model_len=args.context + max_new + 8))
    guards = engine._guards
    prompt = [(7 * i) % 1000 + 10 for i in range(args.context)]
    engine.add_request(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    for _ in range(4):  # prefill and warm-up decodes (the first decode of each kind runs the reference check)
        engine.step()
    times: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
            engine._guards = guards if setting == "on" else {}
            for _ in range(args.steps):
                w0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                times[setting].append((time.perf_counter() - w0, time.process_time() - c0))
    for kind, i in (("wall", 0), ("cpu", 1)):
        on = statistics.median(t[i] for t in times["on"]) * 1e3
        off = statistics.median(t[i] for t in times["off"]) * 1e3
        print(f"{kind}: check on {on:.2f} ms/step, off {off:.2f} ms/step, difference {on - off:+.2f} ms "
              f"({(on - off) / off * 100:+.1f}%)")
    # the check's own device work per step, timed alone: layer 0's flag, the logits' flag, one sync (the
    # per-layer shape/dtype comparison is Python attribute reads)
    c = engine.model.config
    out, logits = torch.randn(1, c.num_attention_heads, c.head_dim), torch.randn(1, c.vocab_size)
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.stack([torch.isfinite(out).all(), torch.isfinite(logits).all()]).tolist()
    print(f"the check's device work alone: {(time.perf_counter() - t0):.3f} ms/step "
          f"(layer-0 output [1, {c.num_attention_heads}, {c.head_dim}], logits [1, {c.vocab_size}])")

if __name__ == "__main__":
    main()
