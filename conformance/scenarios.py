"""The call sequences the op tier replays against a backend and its cache: which sequences get how many new
tokens in each forward call, and where a sequence forks (copy-on-write)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fork", "Call", "Step", "SCENARIOS"]


@dataclass(frozen=True)
class Fork:
    """Fork sequence ``src`` into a new sequence ``dst`` (``KVCacheManager.fork_sequence``)."""

    src: int
    dst: int


Call = tuple[tuple[int, int], ...]  # ((sequence index, new tokens), ...)
Step = Call | Fork

SCENARIOS: dict[str, tuple[Step, ...]] = {
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
    "mixed": (
        ((0, 51), (2, 1), (1, 13)),
        ((1, 13), (2, 1), (0, 13), (3, 13)),
        ((3, 1), (0, 1), (2, 30), (1, 1)),
        ((1, 1), (2, 13), (3, 21), (0, 13)),
        ((0, 1), (1, 1), (2, 1), (3, 1)),
    ),
    "fork": (
        ((0, 21), (3, 9)),
        Fork(0, 1),
        ((0, 1), (1, 1), (3, 1)),
        Fork(1, 2),
        ((2, 6), (1, 1), (0, 1)),
        ((0, 1), (1, 1), (2, 1), (3, 1)),
        Fork(3, 4),
        ((4, 12), (3, 1)),
        ((4, 1), (3, 1), (2, 1), (1, 1), (0, 1)),
    ),
    "long2k": (
        ((0, 1100), (1, 300)),
        ((0, 1000), (1, 1)),
        ((0, 1), (1, 1)),
        ((1, 1030), (0, 1)),
        ((0, 1), (1, 1)),
    ),
    "long4k": (
        ((0, 1024), (1, 700)),
        ((0, 1024), (1, 1)),
        ((0, 1024), (1, 1)),
        ((0, 1023), (1, 1)),
        ((0, 1), (1, 1)),
    ),
}
