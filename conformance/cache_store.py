"""The cache tier's ``store`` case: the KV cache under test driven directly (no backend) against a reference
store, so a cache is judged by what it keeps, not through a backend that may write through its own path.

Script, over two layers and a pool small enough that freed blocks are taken again: three sequences prefill
(5, 9 and 1 tokens) with ``write``; one decode step each; sequence 1 is forked (``fork_sequence``) inside a
partly filled block, and parent and child both append, so the block manager asks for copy-on-write
(``copy_blocks``); sequences 0 and 2 are freed and a new sequence prefills into their blocks; a last decode
step on every live sequence. After every call, every live sequence's ``read`` must equal the rows written
for it (exactly for a lossless cache; within the cache's declared rounding otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.conformance.cases import dtype_suffix
from kvcore.conformance.compare import compare
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import Tolerance
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = ["StoreCase", "check_store", "store_tolerance"]

_LAYERS, _H_KV, _D, _BLOCK = 2, 2, 8, 4
#: (what, seq_ids, query_lens) per call; ("fork", src, dst) and ("free", seq) between calls
_SCRIPT = (
    ("prefill", (0, 1, 2), (5, 9, 1)),
    ("decode", (0, 1, 2), (1, 1, 1)),
    ("fork", 1, 3),
    ("decode after the fork (copy-on-write)", (1, 3, 0), (1, 2, 1)),
    ("free", 0),
    ("free", 2),
    ("prefill into reused blocks", (4,), (7,)),
    ("decode", (1, 3, 4), (1, 1, 1)),
)


@dataclass(frozen=True)
class StoreCase:
    """Every cache the target is tested over (``Target.cache_names``), driven directly."""

    dtype: torch.dtype | None = None

    @property
    def id(self) -> str:
        return f"store{dtype_suffix(self.dtype)}"


def store_tolerance(target: Target) -> Tolerance:
    u = target.unit_roundoff
    # lossless: exact; lossy: one rounding of each stored element (of the row's magnitude, or the element's own),
    # with the model dtype's rounding of the read-back value inside the factor 2
    return Tolerance(atol=2 * u, rtol=2 * u)


def check_store(target: Target, case: StoreCase, cfg: SuiteConfig, result: CaseResult) -> None:
    names = target.cache_names()
    for name in names:
        _check_one(target, name, cfg, result)
        if result.failed:
            return
    result.detail = (f"KV cache {', '.join(names)}: {len(_SCRIPT)} calls (write, fork + copy-on-write, free + block "
                     f"reuse) over {_LAYERS} layers: every read equals what was written ({store_tolerance(target)})")


def _check_one(target: Target, name: str, cfg: SuiteConfig, result: CaseResult) -> None:
    spec = CacheSpec(num_layers=_LAYERS, num_kv_heads=_H_KV, head_dim=_D, dtype=cfg.dtype, device=cfg.torch_device,
                     max_num_seqs=4, max_seq_len=24, block_size=_BLOCK, num_blocks=16)
    kv = KVCacheManager(target.make_cache(name, spec))
    tol = store_tolerance(target)
    gen = torch.Generator().manual_seed(7)
    ref: dict[int, list[torch.Tensor]] = {}  # seq -> per layer [len, 2 (K, V), H_kv, D]
    result.info.update(kv_cache=name, block_size=kv.cache.block_size if kv.cache.paged else None)
    for n, step in enumerate(_SCRIPT, 1):
        what = step[0]
        where = f"call {n}/{len(_SCRIPT)} ({what})"
        result.info["where"] = where
        if what == "fork":
            kv.fork_sequence(step[1], step[2])
            ref[step[2]] = [t.clone() for t in ref[step[1]]]
            continue
        if what == "free":
            kv.free_sequence(step[1])
            del ref[step[1]]
            continue
        seqs, lens = step[1], step[2]
        for s in seqs:
            if s not in ref:
                kv.add_sequence(s)
                ref[s] = [torch.empty(0, 2, _H_KV, _D, dtype=cfg.dtype) for _ in range(_LAYERS)]
        meta = kv.prepare(list(seqs), list(lens), 1.0)
        for layer in range(_LAYERS):
            kv_rows = torch.randn(sum(lens), 2, _H_KV, _D, generator=gen).to(cfg.dtype)
            kv.cache.write(layer, kv_rows[:, 0].to(cfg.torch_device), kv_rows[:, 1].to(cfg.torch_device), meta)
            start = 0
            for s, q in zip(seqs, lens):
                ref[s][layer] = torch.cat([ref[s][layer], kv_rows[start:start + q]])
                start += q
        problem = _read_back(kv, ref, tol)
        if problem:
            result.status = FAIL
            result.detail = f"KV cache '{name}' driven directly, after {where}: {problem}"
            return


def _read_back(kv: KVCacheManager, ref: dict[int, list[torch.Tensor]], tol: Tolerance) -> str | None:
    for s, layers in sorted(ref.items()):
        for layer, want in enumerate(layers):
            k, v = kv.read(layer, s)
            for name, got, expected in (("K", k, want[:, 0]), ("V", v, want[:, 1])):
                if tuple(got.shape) != tuple(expected.shape):
                    return (f"read(layer {layer}) of seq {s} returned {name} of shape {tuple(got.shape)}, expected "
                            f"{tuple(expected.shape)}")
                got, expected = got.float().cpu(), expected.float()
                # a per-row-scaled cache's rounding is relative to the row's largest magnitude (unit_roundoff), so
                # each row is compared in units of that magnitude (at least 1: a per-element rounding stays rtol's)
                unit = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
                m = compare(got / unit, expected / unit, tol)
                if not m.ok:
                    pos, head, dim = m.worst_index
                    return (f"{name} of seq {s} layer {layer} differs from what was written: {m.num_bad}/{m.numel} "
                            f"elements off, worst at position {pos} KV head {head} dim {dim}: got "
                            f"{float(got[pos, head, dim]):.5g}, written {float(expected[pos, head, dim]):.5g}")
    return None
