"""Covering arrays: few rows that still meet every pair (or every value) of several dimensions."""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["covering_array"]


def covering_array(dims: dict[str, Sequence], seed: int, strength: int = 2, candidates: int = 24) -> list[dict]:
    """Rows (dicts dimension -> value) such that every combination of ``strength`` (1 or 2) values of
    different dimensions appears in at least one row. Greedy (each row maximises the newly covered
    combinations among ``candidates`` random completions), seeded: the same rows on every machine."""
    names = list(dims)
    rng = random.Random(seed)
    if strength == 1:
        width = max(len(v) for v in dims.values())
        cols = {}
        for n in names:
            values = list(dims[n])
            rng.shuffle(values)
            cols[n] = (values * (width // len(values) + 1))[:width]
        return [{n: cols[n][i] for n in names} for i in range(width)]
    uncovered = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:] for va in dims[a] for vb in dims[b]}
    order = {n: i for i, n in enumerate(names)}

    def new_pairs(row: dict) -> set:
        keys = sorted(row, key=order.__getitem__)
        return {(a, row[a], b, row[b]) for i, a in enumerate(keys) for b in keys[i + 1:]} & uncovered

    rows = []
    while uncovered:
        pool = sorted(uncovered, key=repr)
        best, best_gain = None, -1
        for _ in range(candidates):
            a, va, b, vb = rng.choice(pool)
            row = {a: va, b: vb}
            for n in rng.sample(names, len(names)):
                if n not in row:
                    row[n] = max(dims[n], key=lambda v, n=n: (len(new_pairs({**row, n: v})), rng.random()))
            gain = len(new_pairs(row))
            if gain > best_gain:
                best, best_gain = row, gain
        uncovered -= new_pairs(best)
        rows.append(best)
    return rows
