"""Adaptive speculation: per running-batch size, speculate only where it pays.

A speculative step verifies N tokens per request to emit its accept length; at batch 1 that is
nearly free, at batch 64 a verify is a 64 x N-row forward that can cost more than the tokens it
yields. Which side of that line a batch size falls on depends on the model, the GPU, the draft
and the prompts, so the engine measures it: for each batch-size bucket (powers of two) it keeps
the emitted tokens per second of speculative steps and of plain decode steps, and runs the
faster. Each side is tried WARMUP_STEPS times before the first choice, and the slower side
again every EXPLORE_EVERY steps, so a choice follows the prompts as they change.

Both sides emit the target's own tokens (greedy: the same tokens, whichever runs), so the
choice changes speed only. A plain decode step still hands the target's hidden states to the
draft (`DraftWorker.absorb`), which catches up on them at its next round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

WARMUP_STEPS = 3  # steps of each side per bucket before choosing
EXPLORE_EVERY = 32  # then one step of the slower side every this many
EMA_WEIGHT = 0.3  # weight of the newest step in a side's rate


@dataclass
class _Rate:
    steps: int = 0
    tok_s: float = 0.0

    def add(self, tok_s: float) -> None:
        self.tok_s = tok_s if self.steps == 0 else (
            EMA_WEIGHT * tok_s + (1 - EMA_WEIGHT) * self.tok_s)
        self.steps += 1


@dataclass
class _Bucket:
    spec: _Rate = field(default_factory=_Rate)
    decode: _Rate = field(default_factory=_Rate)
    since_explore: int = 0


def bucket_of(batch_size: int) -> int:
    """The smallest power of two >= batch_size."""
    return 1 << max(batch_size - 1, 0).bit_length()


class AdaptiveSpeculation:
    def __init__(self):
        self._buckets: dict = {}  # bucket -> _Bucket
        self.chosen: Counter = Counter()  # (bucket, "spec" | "decode") -> steps run

    def use_spec(self, batch_size: int) -> bool:
        """Whether the next step of a running batch of this size should speculate."""
        key = bucket_of(batch_size)
        b = self._buckets.setdefault(key, _Bucket())
        if b.spec.steps < WARMUP_STEPS:
            choice = True
        elif b.decode.steps < WARMUP_STEPS:
            choice = False
        else:
            choice = b.spec.tok_s >= b.decode.tok_s
            b.since_explore += 1
            if b.since_explore >= EXPLORE_EVERY:  # look at the other side again
                b.since_explore, choice = 0, not choice
        self.chosen[(key, "spec" if choice else "decode")] += 1
        return choice

    def record(self, batch_size: int, spec: bool, tokens: int, seconds: float) -> None:
        """A step of `batch_size` requests emitted `tokens` in `seconds` (host wall clock,
        the device included: each step ends in the read of its tokens)."""
        if seconds <= 0:
            return
        b = self._buckets.setdefault(bucket_of(batch_size), _Bucket())
        (b.spec if spec else b.decode).add(tokens / seconds)

    def info(self) -> dict:
        """Per bucket: each side's measured tok/s and how many steps it ran."""
        out = {}
        for key in sorted(self._buckets):
            b = self._buckets[key]
            out[str(key)] = {"spec_tok_s": round(b.spec.tok_s, 1),
                             "decode_tok_s": round(b.decode.tok_s, 1),
                             "spec_steps": self.chosen[(key, "spec")],
                             "decode_steps": self.chosen[(key, "decode")]}
        return out
