"""Chain depth per batch size: how many of a chain's drafts a speculative step verifies.

A verify of d drafts is a forward over d + 1 rows per request. At batch 1 that costs about a
decode step whatever d is, so the whole chain is verified; at batch 64 a chain of 7 is a
512-row forward that costs 2-3 decode steps (an 8B shape on the H100: 2.2 even when nothing is
accepted), while the drafts deep in the chain are the least likely to be accepted. So each
batch-size bucket verifies the depth d of the ladder (`depth_ladder`) that maximises

    expected tokens per step E[d] / seconds of a step at depth d,

where the seconds are the step graph's replay, timed once per (bucket, depth) at capture, and
E[d] = 1 + sum over k <= d of P(the first k drafts are all accepted). Those probabilities come
from every verify so far at any depth (a truncated chain still says whether its first drafts
passed): the share of verifies that reached draft k and accepted it, multiplied over k. A
verify at depth d says nothing of drafts past d, so a bucket held below the full depth runs the
full chain once every EXPLORE_EVERY steps to keep those shares current; a draft no verify has
reached often enough yet counts as accepted, so a bucket cuts only on measured shares.

Truncating a chain is lossless: the draft still proposes its whole chain (its own state stays
what a full round leaves), and the verify accepts exactly the prefix a full verify would have,
cut at d.
"""

from __future__ import annotations

from collections import Counter

# A share is measured once this many verifies reached its draft; until then the draft counts as
# always accepted, so a bucket verifies the whole chain (and measures it) before it cuts. NGRAM's
# shares rise along the chain (0.21, 0.72, 0.83 on chat, H100): taking the first share for the
# deeper ones cut its chains at batch 16 and 64 on a few dozen verifies.
MIN_REACHED = 32
# Counts halve past this many verifies, so the shares follow prompts that change.
DECAY_AT = 2048
REPICK_EVERY = 16  # steps of a bucket between two picks
EXPLORE_EVERY = 64  # a bucket below the full depth runs it once in this many steps
# Another depth must promise this much more to take over (its gain must beat the timing's noise).
DEPTH_MARGIN = 0.05


def depth_ladder(num_steps: int) -> list:
    """The depths a chain of num_steps drafts can be verified at: all of it, about half, one."""
    return sorted({num_steps, (num_steps + 1) // 2, 1})


def accept_shares(hist: Counter, full: int, known: set | None = None) -> list:
    """shares[k - 1]: of verifies that reached draft k (verified at depth >= k, accepted the
    k - 1 before it), the share that accepted it; hist counts (depth, accepted drafts). A draft
    reached by fewer than MIN_REACHED verifies, and never before (`known`: the drafts measured
    so far, updated here), counts as accepted: decay thins the counts of a cut bucket's deep
    drafts, not what they measured."""
    known = set() if known is None else known
    reached, passed = [0.0] * (full + 1), [0.0] * (full + 1)
    for (depth, m), count in hist.items():
        for k in range(1, min(m + 1, depth) + 1):
            reached[k] += count
            if m >= k:
                passed[k] += count
    shares = []
    for k in range(1, full + 1):
        if reached[k] >= MIN_REACHED:
            known.add(k)
        shares.append(passed[k] / reached[k] if k in known and reached[k] > 0 else 1.0)
    return shares


def expected_tokens(shares: list, depth: int) -> float:
    """Tokens a verify of `depth` drafts emits on average: the bonus and each accepted draft."""
    total, alive = 1.0, 1.0
    for share in shares[:depth]:
        alive *= share
        total += alive
    return total


class ChainDepth:
    def __init__(self, hist: Counter, step_seconds: dict):
        """hist: (depth, accepted drafts) -> verifies (the SpecDecoder's, updated as verifies
        resolve); step_seconds: (bucket, depth) -> a step's seconds (capture's replays)."""
        self.hist, self.step_seconds = hist, step_seconds
        self.depths = sorted({d for _, d in step_seconds})
        self.full = self.depths[-1]
        self._picked: dict = {}  # bucket -> depth
        self._known: set = set()  # drafts whose share has been measured (accept_shares)
        self._steps: Counter = Counter()  # bucket -> steps asked

    def depth(self, bucket: int) -> int:
        """The depth the next step of this bucket verifies."""
        n = self._steps[bucket]
        self._steps[bucket] += 1
        current = self._picked.get(bucket, self.full)
        if n % REPICK_EVERY == 0:
            current = self._picked[bucket] = self._pick(bucket, current)
        if current < self.full and n % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return self.full
        return current

    def _pick(self, bucket: int, current: int) -> int:
        if sum(self.hist.values()) > DECAY_AT:
            for key in self.hist:
                self.hist[key] *= 0.5
        shares = accept_shares(self.hist, self.full, self._known)
        rates = {d: expected_tokens(shares, d) / self.step_seconds[(bucket, d)]
                 for d in self.depths if (bucket, d) in self.step_seconds}
        if current not in rates:
            return self.full
        best = max(rates, key=rates.get)
        return best if rates[best] > rates[current] * (1 + DEPTH_MARGIN) else current

    def info(self) -> dict:
        shares = accept_shares(self.hist, self.full, set(self._known))
        return {"depths": self.depths, "picked": {str(b): d for b, d in sorted(self._picked.items())},
                "accept_shares": [round(s, 3) for s in shares],
                "step_ms": {f"{b}x{d}": round(s * 1e3, 3)
                            for (b, d), s in sorted(self.step_seconds.items())}}
