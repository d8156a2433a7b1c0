"""Weighted mixtures of sources: `sharegpt:0.8,gsm8k:0.2`. A name alone weighs 1."""

from __future__ import annotations

import random


def parse_mixture(spec: str) -> list:
    """[(source name or path, weight)] with weights summing to 1."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"data must name a source, got {spec!r}")
    parts = []
    for item in spec.split(","):
        item = item.strip()
        name, sep, weight = item.rpartition(":")
        if not sep or not _is_number(weight):  # no weight (a Windows path's colon included)
            name, weight = item, "1"
        w = float(weight)
        if not name or not w > 0 or w == float("inf"):
            raise ValueError(f"data {spec!r}: {item!r} needs a source name and a weight > 0")
        parts.append((name, w))
    names = [n for n, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"data {spec!r} names a source twice")
    total = sum(w for _, w in parts)
    return [(n, w / total) for n, w in parts]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split_counts(total: int, weights: list) -> list:
    """`total` as integers in proportion to `weights` (largest remainders get the rest)."""
    raw = [total * w for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def draw(pools: list, counts: list, seed: int) -> list:
    """counts[i] samples from pools[i] (seeded, without replacement; a short pool gives all it
    has), interleaved in a seeded order."""
    rng = random.Random(seed)
    out = []
    for pool, k in zip(pools, counts):
        out += rng.sample(pool, min(k, len(pool)))
    rng.shuffle(out)
    return out
