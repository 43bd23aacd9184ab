"""The op-level case matrix.

A case is a head layout (MHA / GQA / MQA), a head size, and a *scenario*: a script of forward calls
over a few sequences. Each call lists ``(sequence, new tokens)`` pairs in the order they are packed;
a sequence's first call is its prefill, later calls with one token are decode steps, later calls
with more continue its cache (chunked prefill). Every call runs on two layers with fresh random
q/k/v.

Scenarios
    ``ragged``      one packed prefill of lengths 1, 15, 16, 17, 33 (around the 16-token block
                    boundary), then batched decode steps, one of them over a permuted subset.
    ``continue``    prefills that continue an existing cache (crossing a block boundary), mixed in one
                    call with a sequence decoding, and a prefill chunk after decode steps.
    ``long``        decode against long caches (1003 and 517 tokens).
    ``fragmented``  the cache is filled with garbage-holding sequences first, then a random subset of
                    them is freed in random order, so the case's sequences get non-adjacent slots or
                    blocks in shuffled physical order (block tables are non-contiguous).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

__all__ = ["OpCase", "HEAD_LAYOUTS", "HEAD_DIMS", "SCENARIOS", "op_cases", "BLOCK_SIZE"]

BLOCK_SIZE = 16
NUM_LAYERS = 2

#: name -> (query heads, KV heads)
HEAD_LAYOUTS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
HEAD_DIMS = (32, 64, 128)

Call = tuple[tuple[int, int], ...]  # ((sequence index, new tokens), ...)

SCENARIOS: dict[str, tuple[Call, ...]] = {
    "ragged": (
        ((0, 1), (1, 15), (2, 16), (3, 17), (4, 33)),
        ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1)),
        ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1)),
        ((3, 1), (0, 1), (4, 1)),
        ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1)),
    ),
    "continue": (
        ((0, 17), (1, 16)),
        ((0, 16), (1, 1)),
        ((0, 1), (1, 1)),
        ((1, 5), (0, 1)),
        ((0, 1), (1, 1)),
    ),
    "long": (
        ((0, 1003), (1, 517)),
        ((0, 1), (1, 1)),
        ((0, 1), (1, 1)),
        ((1, 1), (0, 1)),
    ),
    "fragmented": (
        ((0, 16), (1, 33), (2, 7)),
        ((0, 1), (1, 1), (2, 1)),
        ((0, 1), (1, 1), (2, 1)),
        ((2, 20),),
        ((0, 1), (1, 1), (2, 1)),
        ((2, 1), (1, 1), (0, 1)),
    ),
}


@dataclass(frozen=True)
class OpCase:
    layout: str
    head_dim: int
    scenario: str
    kv_cache: str | None = None  # None: the target's first cache (Target.cache_names)

    @property
    def num_heads(self) -> int:
        return HEAD_LAYOUTS[self.layout][0]

    @property
    def num_kv_heads(self) -> int:
        return HEAD_LAYOUTS[self.layout][1]

    @property
    def calls(self) -> tuple[Call, ...]:
        return SCENARIOS[self.scenario]

    @property
    def fragment(self) -> bool:
        return self.scenario == "fragmented"

    @property
    def num_seqs(self) -> int:
        return 1 + max(i for call in self.calls for i, _ in call)

    @property
    def final_lens(self) -> list[int]:
        lens = [0] * self.num_seqs
        for call in self.calls:
            for i, n in call:
                lens[i] += n
        return lens

    @property
    def id(self) -> str:
        h, hkv = HEAD_LAYOUTS[self.layout]
        base = f"{self.layout}{h}x{hkv}-d{self.head_dim}-{self.scenario}"
        return base if self.kv_cache is None else f"{base}-{self.kv_cache}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def shapes(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "seq_lens": self.final_lens,
            "kv_cache": self.kv_cache,
        }


QUICK = tuple(("ragged", layout, d) for layout in HEAD_LAYOUTS for d in HEAD_DIMS) + (
    ("continue", "gqa", 64),
    ("continue", "mqa", 32),
    ("long", "gqa", 64),
    ("fragmented", "gqa", 64),
    ("fragmented", "mha", 128),
)


def op_cases(quick: bool = False, kv_caches: tuple[str, ...] | None = None) -> list[OpCase]:
    """The case list. ``kv_caches`` (the caches under test): with more than one, every case runs once per
    cache; with one (or None) the target's first cache is used."""
    if quick:
        base = [OpCase(layout, d, s) for s, layout, d in QUICK]
    else:
        base = [OpCase(layout, d, s) for s in SCENARIOS for layout in HEAD_LAYOUTS for d in HEAD_DIMS]
    if not kv_caches or len(kv_caches) < 2:
        return base
    return [OpCase(c.layout, c.head_dim, c.scenario, name) for name in kv_caches for c in base]
