"""KV groups: which layers share one block table, so that sliding-window layers can give blocks back.

A layer with a sliding window ``W`` never reads a key more than ``W - 1`` positions behind its query. Once a
sequence's next query sits at position ``p``, a block all of whose tokens lie before ``p - W + 1`` is dead
for that layer, while a full-attention layer still reads it. So layers are grouped by attention type (the
window, or none), each group with its own block table in the block manager, and a window group gives its dead
blocks back to the pool (vLLM's hybrid KV-cache manager does the same).

All groups share one pool of block ids. For that, a block id must mean the same number of bytes in every
group: each group has the same number of layers (``group_size``, the smallest type's layer count; a type
whose count is not a multiple of it gets a last group with fewer layers, whose unused storage rows are
allocated but idle), and the cache stores ``group_size`` *storage layers*: layer ``l`` writes into storage
layer ``CacheSpec.layer_storage[l]``, shared with one layer of every other group. Gemma 3 (five local layers
to one global) thus has its global layers as one group and its local layers as five groups of the same size.

A ring buffer per windowed layer would save the same memory, but every backend would have to address
wrapped positions; block tables with given-back entries keep every backend's addressing as it is (a
given-back entry reads an arbitrary block whose keys the window masks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.interfaces.layer_attention import LayerAttention

__all__ = ["KVGroup", "KVGroups", "first_live_block", "group_layers", "peak_blocks"]


def first_live_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at ``position`` can still read (it sees the keys at ``position - W + 1`` and
    later): every block before it is dead for a layer with sliding window ``window`` (None: none is)."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: all of one attention type."""

    layers: tuple[int, ...]
    window: int | None  # the layers' sliding window in tokens; None: full attention


@dataclass(frozen=True)
class KVGroups:
    """The block-table groups of a model's layers and where each layer's K/V is stored."""

    groups: tuple[KVGroup, ...]
    #: storage layer of each model layer (``CacheSpec.layer_storage``); None: layer ``l`` is storage layer ``l``
    layer_storage: tuple[int, ...] | None = None

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """The group of each model layer."""
        owner = {layer: i for i, g in enumerate(self.groups) for layer in g.layers}
        return tuple(owner[layer] for layer in sorted(owner))

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk: int | None) -> int:
        """Blocks (all groups) a sequence of ``num_tokens`` holds at its peak (:func:`peak_blocks`)."""
        return peak_blocks(self.windows, num_tokens, block_size, chunk)


def peak_blocks(windows: Sequence[int | None], num_tokens: int, block_size: int, chunk: int | None) -> int:
    """Blocks a sequence of ``num_tokens`` holds at its peak in groups with ``windows``, its tokens computed in
    forwards of at most ``chunk`` tokens (None: all in one forward, which writes every group's blocks)."""
    full = math.ceil(num_tokens / block_size)
    total = 0
    for window in windows:
        if window is None or chunk is None:
            total += full
        else:  # a forward's first query reaches back W - 1 keys; that span covers one more block at most
            total += min(full, (window - 1 + chunk + block_size - 2) // block_size + 1)
    return total


def group_layers(
    layers: Sequence[LayerAttention], num_layers: int, max_len: int, *, free_window_blocks: bool
) -> KVGroups:
    """The groups of a model whose layers attend as ``layers`` (empty: all plain causal) over sequences of at
    most ``max_len`` tokens (a window that long hides nothing). Without ``free_window_blocks``, or without a
    shorter sliding window, every layer is in one full-attention group."""
    windows = [layers[i].sliding_window if layers else None for i in range(num_layers)]
    windows = [w if w is not None and w < max_len else None for w in windows]
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    if not free_window_blocks or set(by_window) == {None}:
        return KVGroups((KVGroup(tuple(range(num_layers)), None),))
    if len(by_window) == 1:  # one window for every layer (Mistral): one group, no storage to share
        (window,) = by_window
        return KVGroups((KVGroup(tuple(range(num_layers)), window),))
    size = min(len(members) for members in by_window.values())
    groups, storage = [], [0] * num_layers
    # full attention first: group 0 addresses every token, so a reader of one table gets them all
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        members = by_window[window]
        for start in range(0, len(members), size):
            chunk = tuple(members[start : start + size])
            groups.append(KVGroup(chunk, window))
            for row, layer in enumerate(chunk):
                storage[layer] = row
    return KVGroups(tuple(groups), tuple(storage))
