"""What holding the weights in huge pages saves at batch-1 decode: two engines on the embedded SmolLM2 GGUF with the
default configuration, side by side in one process, one as kvcore builds it (its kvcore-kernel weights and int4 head
in one region each, advised into 2 MiB pages: ``kvcore/kernels/huge_pages.py``), the other with every one of those
tensors copied back into a plain allocation of its own (4 KiB pages where transparent huge pages are ``madvise``).

    .venv/bin/python benchmarks/ab/huge_pages.py [--reps 8] [--new 128] [--threads 2]

The two engines alternate request by request (a 64-token prompt, ``--new`` greedy tokens, ``ignore_eos``); reported:
each side's decode tok/s per repetition, the medians and the ratio of medians, the resident huge pages, and whether
both streams are the same tokens.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvcore import Engine, EngineConfig
from kvcore.kernels.cpu import cpu_features
from kvcore.kernels.huge_pages import Relocatable, huge_page_reason


def _anon_huge_mib() -> float:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _to_plain_pages(engine: Engine) -> None:
    """Every weight the engine holds in huge pages copied into an allocation of its own."""
    matmuls = [f for fns in engine.model._quantized.values() for f in fns if isinstance(f, Relocatable)]
    for f in [*matmuls, engine.runner.head.int4]:
        f.relocate(lambda t: t.clone())
    engine.model.__dict__.pop("_fused_weights", None)  # the decode stack's lists of the old tensors


def main() -> None:
    from kvcore_bench.common import TEXT
    from kvcore_bench.runs import kv_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reason = huge_page_reason()
    before = _anon_huge_mib()
    huge = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=256))
    held = _anon_huge_mib() - before
    plain = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=256))
    _to_plain_pages(plain)
    sides = {"huge pages": huge, "4 KiB pages": plain}
    text = huge.tokenizer.encode(TEXT, add_bos=False)
    prompt = [(text * 4)[:64]]
    streams = {name: kv_run(e, prompt, 8).token_ids for name, e in sides.items()}  # warm-up
    tok_s: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
            run = kv_run(sides[name], prompt, args.new)
            tok_s[name].append(run.decode_tok_s)
            streams[name] = run.token_ids
    print(f"{cpu_features().describe()}; transparent huge pages: {reason or 'available'}; "
          f"huge pages resident after the first engine's load: {held:.0f} MiB")
    print("| side | decode tok/s per repetition | median |")
    print("|---|---|---|")
    for name, values in tok_s.items():
        print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.1f} |")
    ratio = statistics.median(tok_s["huge pages"]) / statistics.median(tok_s["4 KiB pages"])
    print(f"\nhuge / 4 KiB pages: {ratio:.3f}x (medians); same greedy tokens: "
          f"{streams['huge pages'] == streams['4 KiB pages']}")


if __name__ == "__main__":
    main()
