"""Memory at each load stage of the default configuration (SmolLM2 Q4_1: int4a8 weights, int4 head, cpu_decode):
RSS, the stage's own peak (VmHWM reset before it), anonymous and file-backed pages, all above the import baseline;
at the end what the model holds and the growth per mapping (smaps). Linux only::

    python benchmarks/studies/memory_stages.py
"""

from __future__ import annotations

import collections

import torch

from kvcore.engine.core import Engine, EngineConfig
from kvcore.interfaces.sampler import SamplingParams
from kvcore.loaders.heap import load_scope, trim_heap
from kvcore.loaders.load import build_model, load_model

MIB = 2**20


def status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024 / MIB
    return out


def smaps() -> collections.Counter:
    out: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts[0].endswith(":"):  # a mapping's header line
                name = parts[5].split("/")[-1] if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:":
                out[name] += int(parts[1]) * 1024 / MIB
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    base, base_maps = status(), smaps()
    reset_peak()

    def mark(stage: str) -> None:
        s = status()
        reset_peak()
        print(f"| {stage} | {s['VmRSS'] - base['VmRSS']:.0f} | {s['VmHWM'] - base['VmRSS']:.0f} | "
              f"{s['RssAnon'] - base['RssAnon']:.0f} | {s['RssFile'] - base['RssFile']:.0f} |", flush=True)

    print(f"import baseline {base['VmRSS']:.0f} MiB (anon {base['RssAnon']:.0f}, file {base['RssFile']:.0f})\n")
    print("| stage | RSS above import (MiB) | stage peak above import | anon above import | file-backed above import |")
    print("|---|---|---|---|---|")
    with load_scope():  # as Engine.from_pretrained does
        loaded = load_model("smollm2", keep_quantized=True)
        mark("load_model (metadata, tokenizer; tensors not read)")
        model = build_model(loaded, torch.bfloat16, "cpu", 136, weights="int4a8")
        tok = loaded.tokenizer
        del loaded
        trim_heap()
        mark("build_model (layers packed, embedding as its Q8_0 blocks in the file); heap trimmed")
        config = EngineConfig(dtype="bfloat16", weights="int4a8", lm_head="int4", backend="cpu_decode",
                              max_model_len=136, max_num_seqs=1)
        engine = Engine(model, tok, config)
    mark("Engine (int4 head, KV cache, backends); heap trimmed")
    engine.add_request(tok.encode("Tell me a story about a dragon."),
                       SamplingParams(max_new_tokens=128, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    mark("generate 128 tokens")

    packed = sum(lin.nbytes for lists in model._quantized.values() for lin in lists) / MIB
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    dense = sum(t.nbytes for t in tensors) / MIB
    table = model.embedding.nbytes if model.embedding is not None else 0
    where = "read from the file per lookup, not held" if table and model.embedding.blocks.in_file else "held"
    print(f"\nheld by the model: packed layer matmuls {packed:.1f} MiB, embedding (GGUF blocks, {where}) "
          f"{table / MIB:.1f} MiB, parameters + buffers (norms, RoPE) {dense:.1f} MiB, int4 head "
          f"{engine.lm_head.nbytes / MIB:.1f} MiB")
    now = smaps()
    growth = sorted(((k, v - base_maps.get(k, 0)) for k, v in now.items()), key=lambda kv: -kv[1])[:6]
    print("growth by mapping (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in growth))


if __name__ == "__main__":
    main()
