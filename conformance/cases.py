"""The op-level case matrix.

A case is a head layout (query heads over KV heads), a head size, a block size (paged caches) and a
*scenario*: a script of forward calls over a few sequences. Each call lists ``(sequence, new tokens)``
pairs in the order they are packed; a sequence's first call is its prefill, later calls with one token
are decode steps, later calls with more continue its cache (chunked prefill). A :class:`Fork` step forks
a sequence through :meth:`~kvcore.scheduling.kv_manager.KVCacheManager.fork_sequence` (the child shares the
parent's blocks; the first append on either side copies the shared partial block). Every call runs on
two layers with fresh random q/k/v.

Scenarios
    ``ragged``      one packed prefill of lengths 1, 15, 16, 17, 33 (around the 16-token block
                    boundary), then batched decode steps, one of them over a permuted subset.
    ``continue``    prefills that continue an existing cache (crossing a block boundary), mixed in one
                    call with a sequence decoding, and a prefill chunk after decode steps.
    ``long``        decode against long caches (1003 and 517 tokens).
    ``fragmented``  the cache is filled with garbage-holding sequences first, then a random subset of
                    them is freed in random order, so the case's sequences get non-adjacent slots or
                    blocks in shuffled physical order (block tables are non-contiguous).
    ``mixed``       calls packing first prefills, prefill chunks at *different* context offsets and
                    decode rows together; the same chunk length (13) recurs at offsets 0, 13, 51, 0,
                    32, 65 (inside and past a 64-key tile), so a mask or plan memoised by query length
                    or tile shape alone, or one offset used for every chunk of a call, is wrong.
    ``fork``        forks of a partly filled block; then parent and children all append (copy-on-write),
                    a child continues with a prefill chunk, a fork of a fork.
    ``long2k``      contexts past 1,024 and 2,048 keys (split-KV / tiled paths): a 1,000-token chunk at
                    offset 1,100 mixed with a decode row, decode against 2,101 keys, a chunk crossing
                    1,024 keys.
    ``long4k``      up to 4,096 keys (the engine's default context limit), in chunks of 1,024 queries.

The matrix (:func:`op_cases`) is the *legacy* corner set (MHA 8/8, GQA 8/2, MQA 8/1 × head_dim 32, 64,
128 × ``ragged``, ``continue``, ``long``, ``fragmented`` at block size 16; ``--quick``: 14 of them) plus
seeded **covering arrays** over ``LAYOUTS × HEAD_SIZES × BLOCK_SIZES × SHORT_SCENARIOS`` (a greedy
AETG-style construction with a fixed seed, so the list is the same on every machine): in full two pairwise
ones, where every pair of values of any two dimensions appears in at least one case; in ``--quick`` one in
which every value of every dimension appears, so quick covers each dimension and leaves their combinations
to full. Long contexts: hand-picked ``long2k`` rows (a non-power-of-two group, a head size that is not a
multiple of 32, block size 12; full adds rows with block sizes 1 and 64 and one with head_dim 256),
and in full ``long2k`` with every layout, head size and block size at least once, the legacy ``long``
cases and three ``long4k`` rows. Each reduced precision runs a smaller array in which each value of each
dimension appears at least once, plus one ``long2k`` row (``long4k`` too in full), so rounding over long
reductions is covered.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvcore.conformance._covering import covering_array
from kvcore.conformance.scenarios import SCENARIOS, Fork, Step
from kvcore.interfaces.dtypes import dtype_name

__all__ = [
    "OpCase", "Fork", "HEAD_LAYOUTS", "HEAD_DIMS", "LAYOUTS", "HEAD_SIZES", "BLOCK_SIZES", "SCENARIOS",
    "op_cases", "on_caches", "base_cases", "reduced_cases", "covering_array", "BLOCK_SIZE", "REDUCED_DTYPES",
    "dtype_suffix",
]

BLOCK_SIZE = 16  # default block size of paged caches (the engine's)
NUM_LAYERS = 2

#: legacy corner layouts: name -> (query heads, KV heads)
HEAD_LAYOUTS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
HEAD_DIMS = (32, 64, 128)

#: every layout of the covering array: name -> (query heads, KV heads); GQA groups 1, 2, 3, 4, 5, 6, 8 and MQA
LAYOUTS = {
    "mha": (8, 8),  # group 1
    "gqa8x4": (8, 4),  # group 2
    "gqa6x2": (6, 2),  # group 3
    "gqa": (8, 2),  # group 4
    "gqa10x2": (10, 2),  # group 5
    "gqa12x2": (12, 2),  # group 6
    "gqa16x2": (16, 2),  # group 8
    "mqa": (8, 1),  # H_kv = 1, group 8
    "mqa6x1": (6, 1),  # H_kv = 1, group 6
}
#: head sizes, several not a multiple of 32 (vectorised / padded kernels); 256 runs where declared
HEAD_SIZES = (32, 40, 64, 72, 80, 96, 112, 128, 256)
#: paged caches: tokens per block, one not a power of two
BLOCK_SIZES = (1, 8, 12, 16, 32, 64)
#: the precisions below float32 the suite certifies by default
REDUCED_DTYPES = (torch.bfloat16, torch.float16)


LEGACY_SCENARIOS = ("ragged", "continue", "long", "fragmented")
#: the scenarios of the pairwise arrays (cheap: at most 70 tokens per sequence)
SHORT_SCENARIOS = ("ragged", "continue", "fragmented", "mixed", "fork")
#: long contexts, each a few seconds per case: a hand-picked row in --quick (and in each reduced precision), one
#: row per value in full
LONG_QUICK = (("gqa6x2", 80, "long2k", 12),)
#: full: more hand-picked rows, the widest last (the heaviest: 10 heads of 256 over 2,100 keys)
LONG_FULL = (("gqa10x2", 72, "long2k", 1), ("mqa", 40, "long2k", 64), ("gqa10x2", 256, "long2k", 1))
LONG4K = (("gqa", 128, "long4k", 16), ("gqa12x2", 72, "long4k", 12), ("mqa6x1", 112, "long4k", 1))


def dtype_suffix(dtype: torch.dtype | None) -> str:
    """Case-id suffix of a reduced-precision case (``""`` for float32 / the run's dtype)."""
    if dtype is None or dtype == torch.float32:
        return ""
    return {torch.bfloat16: "-bf16", torch.float16: "-fp16"}.get(dtype, "-" + dtype_name(dtype))


@dataclass(frozen=True)
class OpCase:
    layout: str
    head_dim: int
    scenario: str
    kv_cache: str | None = None  # None: the target's first cache (Target.cache_names)
    block_size: int = BLOCK_SIZE  # paged caches only (passed as the cache's block_size option)
    dtype: torch.dtype | None = None  # None: the run's dtype

    @property
    def num_heads(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def num_kv_heads(self) -> int:
        return LAYOUTS[self.layout][1]

    @property
    def calls(self) -> tuple[Step, ...]:
        return SCENARIOS[self.scenario]

    @property
    def fragment(self) -> bool:
        return self.scenario == "fragmented"

    @property
    def num_seqs(self) -> int:
        idx = [i for c in self.calls if not isinstance(c, Fork) for i, _ in c]
        idx += [c.dst for c in self.calls if isinstance(c, Fork)]
        return 1 + max(idx)

    @property
    def final_lens(self) -> list[int]:
        lens = [0] * self.num_seqs
        for call in self.calls:
            if isinstance(call, Fork):
                lens[call.dst] = lens[call.src]
                continue
            for i, n in call:
                lens[i] += n
        return lens

    @property
    def id(self) -> str:
        h, hkv = LAYOUTS[self.layout]
        name = self.layout if self.layout in HEAD_LAYOUTS else self.layout.rstrip("0123456789x")
        base = f"{name}{h}x{hkv}-d{self.head_dim}-{self.scenario}"
        if self.block_size != BLOCK_SIZE:
            base += f"-bs{self.block_size}"
        if self.kv_cache is not None:
            base += f"-{self.kv_cache}"
        return base + dtype_suffix(self.dtype)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def shapes(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "seq_lens": self.final_lens,
            "kv_cache": self.kv_cache,
        }


def _picks(rows) -> list[OpCase]:
    return [OpCase(layout, d, s, block_size=bs) for layout, d, s, bs in rows]


def _array(scenarios: Sequence[str], seed: int, strength: int = 2) -> list[OpCase]:
    dims = {"layout": list(LAYOUTS), "head_dim": HEAD_SIZES, "block_size": BLOCK_SIZES, "scenario": scenarios}
    return [OpCase(r["layout"], r["head_dim"], r["scenario"], block_size=r["block_size"])
            for r in covering_array(dims, seed, strength)]


QUICK_LEGACY = tuple(("ragged", layout, d) for layout in HEAD_LAYOUTS for d in HEAD_DIMS) + (
    ("continue", "gqa", 64),
    ("continue", "mqa", 32),
    ("long", "gqa", 64),
    ("fragmented", "gqa", 64),
    ("fragmented", "mha", 128),
)


def _dedupe(cases: list[OpCase]) -> list[OpCase]:
    seen, out = set(), []
    for c in cases:
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


def base_cases(quick: bool) -> list[OpCase]:
    """The float32 case list (before the per-cache expansion): in ``quick`` every value of every dimension once
    and one long context, each dimension covered rather than its combinations; full, the pairwise arrays and the
    long rows."""
    if quick:
        legacy = [OpCase(layout, d, s) for s, layout, d in QUICK_LEGACY]
        return _dedupe(legacy + _array(SHORT_SCENARIOS, seed=0, strength=1) + _picks(LONG_QUICK))
    legacy = [OpCase(layout, d, s) for s in LEGACY_SCENARIOS for layout in HEAD_LAYOUTS for d in HEAD_DIMS]
    pairwise = _array(SHORT_SCENARIOS, seed=0) + _array(SHORT_SCENARIOS, seed=1)
    longs = _picks(LONG_QUICK + LONG_FULL) + _array(("long2k",), seed=4, strength=1) + _picks(LONG4K)
    return _dedupe(legacy + pairwise + longs)


def reduced_cases(quick: bool) -> list[OpCase]:
    """The cases each reduced precision runs: every value of every dimension at least once, plus a
    long reduction (``long2k``; full: also ``long4k``) at a grouped layout."""
    rows = _array(SHORT_SCENARIOS, seed=2, strength=1) + _picks(LONG_QUICK)
    if not quick:
        rows += _array(SHORT_SCENARIOS, seed=3, strength=1) + _picks(LONG4K[:1])
    return _dedupe(rows)


def op_cases(
    quick: bool = False,
    kv_caches: tuple[str, ...] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
) -> list[OpCase]:
    """The case list. ``kv_caches`` (the caches under test): with more than one, every case runs once per
    cache (:func:`on_caches`); with one (or None) the target's first cache is used. ``dtypes``: float32 runs the
    full matrix (:func:`base_cases`), each reduced precision :func:`reduced_cases`."""
    base: list[OpCase] = []
    for dtype in dtypes:
        rows = base_cases(quick) if dtype == torch.float32 else reduced_cases(quick)
        tag = None if len(dtypes) == 1 else dtype
        base += [replace(c, dtype=tag) for c in rows]
    return on_caches(base, kv_caches)


def on_caches(cases: Sequence[OpCase], kv_caches: tuple[str, ...] | None, quick: bool = False) -> list[OpCase]:
    """``cases`` over the caches under test: with one (or None) as they are (the target's first cache); with
    several, in full every case once per cache; in ``quick`` each case once, the caches taking turns among the
    cases of each scenario and precision, so every cache meets every scenario (long contexts included) and
    precision that has a case per cache, and the cache dimension is covered rather than crossed."""
    if not kv_caches or len(kv_caches) < 2:
        return list(cases)
    if not quick:
        return [replace(c, kv_cache=name) for name in kv_caches for c in cases]
    turns: dict[tuple, int] = {}
    spread = []
    for c in cases:
        precision = None if c.dtype == torch.float32 else c.dtype  # a run's first dtype is float32 or its only one
        turn = turns[c.scenario, precision] = turns.get((c.scenario, precision), -1) + 1
        spread.append(replace(c, kv_cache=kv_caches[turn % len(kv_caches)]))
    return spread
