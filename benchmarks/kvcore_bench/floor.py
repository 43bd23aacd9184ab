"""The memory-bandwidth floor of batch-1 decode: what a step must read, and how fast this machine reads it.

At batch 1 a decode step reads every layer matmul weight and the LM head once, so a step takes at least
``bytes per token / read bandwidth``; ``tok/s x bytes per token`` against the read bandwidth measured in the same
minutes says how close a run came to that floor.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from kvcore.engine.core import Engine
from kvcore.loaders.gguf_validate import validate_gguf

__all__ = ["kvcore_bytes_per_token", "llamacpp_bytes_per_token", "read_bandwidth"]


def kvcore_bytes_per_token(engine: Engine) -> dict[str, int]:
    """What a batch-1 step of ``engine``'s model reads: its layer matmul weights and its LM head."""
    model = engine.model
    if model.weight_format == "float":
        raise SystemExit(f"the default configuration here runs float weights ({engine.choice.describe()}): "
                         "this bound is for the quantized one")
    layers = sum(lin.nbytes for name in ("qkv", "o", "gate_up", "down") for lin in model.matmuls(1)[name])
    head = engine.lm_head.nbytes if engine.lm_head is not None else model.lm_head.nbytes
    return {"layer matmuls": layers, "LM head": head}


def llamacpp_bytes_per_token(path: os.PathLike) -> dict[str, int]:
    """What llama.cpp reads per batch-1 token of the GGUF file ``path``: every tensor but the token embedding,
    plus the embedding table itself when the file ties it to the output."""
    tensors = {t.name: t.nbytes for t in validate_gguf(path).tensors}
    embed = tensors.pop("token_embd.weight")
    out = {"layer tensors": sum(n for name, n in tensors.items() if name != "output.weight")}
    out["LM head"] = tensors.get("output.weight", embed)  # tied: the embedding table is the output matrix
    return out


def read_bandwidth(nbytes: int, threads: int, seconds: float = 2.0) -> float:
    """Median bytes/s of summing a buffer of ``nbytes`` on ``threads`` threads, read back to back."""
    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)
