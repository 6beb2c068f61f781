"""Which rows of an insert batch a shard holds: bucket *ranges*, not bucket lists.

A retried insert must be applied once even if the shard was split, merged or moved in
between, so every shard remembers, per recent batch id, the buckets of that batch whose rows
it holds. An append to a unit carries every row of its batch that falls in the unit's bucket
range (the session routes a whole batch by unit, and a unit keeps its range for life), so
after the append the shard holds every row of the batch in ``[min, max]`` of the appended
buckets. That claim is one range whatever the number of buckets, which lets the bucket count
be fine-grained (up to 2^30) without a batch's record growing with its rows.

A claim stays true when rows move: a split or merge carries a bucket range's rows wherever
the range goes, so a claim adopted from the shard(s) a unit replaces may reach beyond the
unit's own range without being wrong (no row outside the range is ever appended to it).

Records written before ranges list single buckets (``[3, 17]``); they read as one-bucket
ranges. ``None`` stands for every row of the batch (replicated tables).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Held = list[list[int]] | None
"""Sorted, disjoint ``[lo, hi)`` bucket ranges, as JSON keeps them; None: all of the batch."""


def ranges(held: Sequence[int | Sequence[int]]) -> list[list[int]]:
    """``held`` as sorted, disjoint, coalesced ``[lo, hi)`` ranges (bare ints: one bucket)."""
    spans = sorted(
        (int(item), int(item) + 1) if isinstance(item, int | np.integer) else (item[0], item[1])
        for item in held
    )
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def merge_held(held: Held, more: Held) -> Held:
    """What a shard holds of a batch after adding ``more`` to ``held``."""
    if held is None or more is None:
        return None
    return ranges([*held, *more])


def covered(buckets: np.ndarray, held: Held) -> np.ndarray:
    """Per row (by its bucket), whether ``held`` covers it already."""
    if held is None:
        return np.ones(len(buckets), dtype=bool)
    spans = ranges(held)
    if not spans:
        return np.zeros(len(buckets), dtype=bool)
    starts = np.array([lo for lo, _ in spans], dtype=np.int64)
    ends = np.array([hi for _, hi in spans], dtype=np.int64)
    at = np.searchsorted(starts, buckets, side="right") - 1
    inside = at >= 0
    return inside & (buckets < ends[np.maximum(at, 0)])


def claim(buckets: np.ndarray | None) -> Held:
    """What an append of rows with these buckets lets the shard claim (see the module)."""
    if buckets is None:
        return None
    if len(buckets) == 0:
        return []
    return [[int(buckets.min()), int(buckets.max()) + 1]]
