"""KV memory of a sliding-window model with the window pool on and off (EngineConfig.free_window_blocks).

Two parts, each run with the pool on and off, alternating, on the ``paged`` backend in float32 (greedy):

* ``8k``: a random Gemma 3 text model with the real 270M's attention geometry read from the GGUF's metadata
  (18 layers, every sixth global, its sliding window, KV heads and head_dim; narrow hidden and MLP widths, which
  do not change the KV bytes): one request of ``--prompt`` + ``--new`` tokens (8,192 by default). Measured: the
  KV bytes the sequence holds after its last decode step (``KVCacheManager.kv_bytes_in_use``), its peak over
  the request (``metrics.kv_bytes``), the capacity report, how many such sequences a 1 GiB budget holds, and
  whether the two greedy streams are the same.
* ``real``: the GGUF itself (weights dequantized), a prompt longer than its window, greedy streams on and off.

    python benchmarks/studies/window_kv.py          # writes benchmarks/results/window-kv.{md,json}
    python benchmarks/studies/window_kv.py --prompt 2000 --new 48 --out /tmp/wkv
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import gguf
import torch

from kvcore import Engine, EngineConfig, LlamaModel, ModelConfig, SamplingParams
from kvcore.loaders import build_model, load_model

GIB = 2**30


def gguf_geometry(path: str) -> dict:
    reader = gguf.GGUFReader(path)

    def value(key: str) -> int:
        field = reader.fields[f"gemma3.{key}"]
        return int(field.parts[field.data[0]][0])

    return {"layers": value("block_count"), "window": value("attention.sliding_window"),
            "kv_heads": value("attention.head_count_kv"), "head_dim": value("attention.key_length"),
            "heads": value("attention.head_count")}


def random_gemma3(geo: dict, max_positions: int) -> LlamaModel:
    n = geo["layers"]
    cfg = ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=geo["heads"],
        num_key_value_heads=geo["kv_heads"], head_dim=geo["head_dim"], max_position_embeddings=max_positions,
        architecture="gemma3", qk_norm=True, norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=geo["head_dim"], sliding_window=geo["window"], rope_local_base_freq=10000.0,
        rope_theta=1e6, sliding_window_layers=tuple(i for i in range(n) if (i + 1) % 6), tie_word_embeddings=True,
        embedding_multiplier=8.0, eos_token_id=1,
    )
    gen = torch.Generator().manual_seed(0)
    model = LlamaModel(cfg, torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))
    return model


def measure(model: LlamaModel, prompt: list[int], new: int, on: bool, chunk: int) -> dict:
    """One greedy request through the paged backend with the window pool on or off."""
    total = len(prompt) + new
    config = dict(backend="paged", dtype="float32", max_model_len=total, free_window_blocks=on)
    engine = Engine(model, None, EngineConfig(**config, max_num_seqs=1, max_num_batched_tokens=chunk))
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    held = 0
    while engine.has_unfinished():
        engine.step()
        held = engine.kv.kv_bytes_in_use() or held  # the last step frees the sequence: keep the one before
    seconds = time.perf_counter() - start
    result = engine.release(rid)
    cap = engine.kv.capacity()
    budget = Engine(model, None, EngineConfig(**config, kv_cache_bytes=GIB)).kv.capacity()
    return {"window_pool": engine.kv.window_pool, "seconds": round(seconds, 1), "held_bytes_at_end": held,
            "peak_bytes": result.metrics.kv_bytes, "capacity_seq_bytes": cap.seq_bytes,
            "seq_bytes_all_layers": cap.seq_bytes_all_layers, "seqs_per_gib": budget.num_seqs,
            "no_block_left": engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks,
            "token_ids": result.token_ids}


def table(on: dict, off: dict) -> list[str]:
    def row(name: str, key: str) -> str:
        return f"| {name} | {on[key]:,} | {off[key]:,} | {off[key] / on[key]:.2f}x |"

    return [
        "| | pool on | pool off | off / on |",
        "|---|---|---|---|",
        row("KV bytes held after the last decode step", "held_bytes_at_end"),
        row("capacity report: bytes per computed sequence of this length", "capacity_seq_bytes"),
        row("peak over the request (`metrics.kv_bytes`)", "peak_bytes"),
        f"| such sequences in a 1 GiB `kv_cache_bytes` | {on['seqs_per_gib']} | {off['seqs_per_gib']} | |",
        f"| request time (s, shared machine) | {on['seconds']} | {off['seconds']} | |",
        "",
        f"Greedy streams identical on and off: **{on['token_ids'] == off['token_ids']}**; every block back in the "
        f"pool after the request: on {on['no_block_left']}, off {off['no_block_left']}.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = os.environ.get("KVCORE_GEMMA3_GGUF")
    ap.add_argument("--gguf", default=env, required=env is None,
                    help="the Gemma 3 270M GGUF (default: $KVCORE_GEMMA3_GGUF)")
    ap.add_argument("--prompt", type=int, default=8128, help="prompt tokens of the 8k part")
    ap.add_argument("--new", type=int, default=64, help="decoded tokens of the 8k part")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--real-prompt", type=int, default=700, help="prompt tokens of the real-model part")
    ap.add_argument("--real-new", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    geo = gguf_geometry(args.gguf)
    model = random_gemma3(geo, args.prompt + args.new)
    prompt = torch.randint(2, 512, (args.prompt,)).tolist()
    eight_k = {on: measure(model, prompt, args.new, on, args.chunk) for on in (True, False)}
    real_model = build_model(load_model(args.gguf), max_model_len=args.real_prompt + args.real_new)
    real_prompt = torch.randint(2, 200_000, (args.real_prompt,)).tolist()
    real = {on: measure(real_model, real_prompt, args.real_new, on, args.chunk) for on in (False, True)}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, shared",
        "geometry": geo, "chunk": args.chunk,
        "8k": {str(k): v for k, v in eight_k.items()}, "real": {str(k): v for k, v in real.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window-kv.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "# KV memory with sliding windows: the window pool on and off",
        "",
        f"Command: `python benchmarks/studies/window_kv.py --prompt {args.prompt} --new {args.new} "
        f"--chunk {args.chunk} "
        f"--real-prompt {args.real_prompt} --real-new {args.real_new}` ({report['machine']}, other jobs running; "
        "float32, `paged` backend, greedy; pool on first for the random model, off first for the GGUF).",
        "",
        f"Model geometry from `{Path(args.gguf).name}`'s metadata: {geo['layers']} layers (every sixth global), "
        f"sliding window {geo['window']}, {geo['kv_heads']} KV head(s) of {geo['head_dim']}.",
        "",
        f"## A random model with that geometry, one sequence of {args.prompt + args.new:,} tokens",
        "",
        "Narrow hidden and MLP widths (the KV bytes depend only on the geometry above).",
        "",
        *table(eight_k[True], eight_k[False]),
        f"The peak comes with the prompt's prefill chunks ({args.chunk} tokens): a chunk's queries reach back one "
        "window, so each window layer holds at most window + chunk tokens while the prompt is computed.",
        "",
        f"## The GGUF itself (weights dequantized): {args.real_prompt}-token prompt, {args.real_new} new tokens",
        "",
        *table(real[True], real[False]),
        "",
    ]
    (out / "window-kv.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
