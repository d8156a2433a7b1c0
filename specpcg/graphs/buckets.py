"""Capture sizes: token-count buckets for piecewise graphs, batch-size buckets for decode graphs.

Every list is sorted ascending; a batch is padded up to `pick_bucket(buckets, n)`.
"""

from __future__ import annotations

import bisect

# (first, last, step) runs of SGLang's default piecewise capture sizes; past the last run the
# sizes go on in steps of 512 up to max_tokens. Dense where prefills are common (short chunks),
# sparse where padding waste is a small fraction of the batch anyway.
_PIECEWISE_RUNS = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
_PIECEWISE_TAIL_START, _PIECEWISE_TAIL_STEP = 4608, 512


def piecewise_token_buckets(max_tokens: int) -> list[int]:
    """SGLang's default sizes <= max_tokens (58 of them for 8192); max_tokens itself is added
    only when it is one of them, so the largest bucket may sit below max_tokens."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    sizes = [n for first, last, step in _PIECEWISE_RUNS for n in range(first, last + 1, step)]
    sizes += range(_PIECEWISE_TAIL_START, max_tokens + 1, _PIECEWISE_TAIL_STEP)
    return [n for n in sizes if n <= max_tokens]


def decode_batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, capped at max_bs; max_bs is always the largest bucket."""
    if not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"max_bs must be a positive int, got {max_bs!r}")
    sizes = [n for n in (1, 2, 4, 8) if n < max_bs] + list(range(16, max_bs, 8))
    return sizes + [max_bs]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all. buckets: sorted ascending."""
    if n < 1:
        raise ValueError(f"a batch needs at least one token/request to pick a bucket, got {n!r}")
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
