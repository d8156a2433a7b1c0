"""Chain depth per batch size: how many of a chain's drafts a speculative step verifies.

A verify of d drafts is a forward over d + 1 rows per request. At batch 1 that costs about a
decode step whatever d is, so the whole chain is verified; at batch 64 a chain of 7 is a
512-row forward that costs 2-3 decode steps (an 8B shape on the H100: 2.2 even when nothing is
accepted), while the drafts deep in the chain are the least likely to be accepted. So each
batch-size bucket verifies the depth d of the ladder (`depth_ladder`) that maximises

    expected tokens per step E[d] / seconds of a step at depth d,

where the seconds are the steps' own, as run (`StepTimer`), and, for a depth the bucket has not
run, the step graph's replay timed at capture, scaled by how much slower than their replays the
bucket's steps ran (the replays run on padding rows with no keys: attention over real contexts
is not in them). E[d] = 1 + sum over k <= d of P(the first k drafts are all accepted). Those
probabilities come from every verify so far at any depth (a truncated chain still says whether
its first drafts passed): the share of verifies that reached draft k and accepted it,
multiplied over k. A verify at depth d says nothing of drafts past d, so a bucket held below the
full depth runs the full chain once every EXPLORE_EVERY steps to keep those shares current; a
draft no verify has reached often enough yet counts as accepted, so a bucket cuts only on
measured shares.

Truncating a chain is lossless: the draft still proposes its whole chain (its own state stays
what a full round leaves), and the verify accepts exactly the prefix a full verify would have,
cut at d.
"""

from __future__ import annotations

from collections import Counter, deque
from statistics import median
from typing import Optional

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
# A (bucket, depth)'s step time is the median of its last MEASURED_STEPS steps, once it has
# MIN_MEASURED of them; before that, the replay's (see ChainDepth.seconds).
MEASURED_STEPS = 16
MIN_MEASURED = 4


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
        self._measured: dict = {}  # (bucket, depth) -> the last MEASURED_STEPS step seconds

    def observe(self, bucket: int, depth: int, seconds: float) -> None:
        """A step of this bucket and depth took `seconds` (StepTimer)."""
        key = (bucket, depth)
        if key not in self._measured:
            self._measured[key] = deque(maxlen=MEASURED_STEPS)
        self._measured[key].append(seconds)

    def seconds(self, bucket: int, depth: int) -> Optional[float]:
        """A step's seconds: measured where this bucket has run the depth; else the capture's
        replay times how much slower than their replays the bucket's measured depths ran (at
        least 1). The replays run on padding rows with no keys, so attention over real contexts
        is not in them: on the 8B shape at batch 64 (H100) a whole-chain step measured 16.0 ms
        where its replay took 13.0. A ratio, not a surplus per verified row: where the host
        sets the pace (the default model at batch 64), a cut step saves less than its rows."""
        times = self._measured.get((bucket, depth), ())
        if len(times) >= MIN_MEASURED:
            return median(times)
        replay = self.step_seconds.get((bucket, depth))
        if replay is None:
            return None
        ratios = [max(1.0, median(t) / self.step_seconds[(b, d)])
                  for (b, d), t in self._measured.items()
                  if b == bucket and len(t) >= MIN_MEASURED and (b, d) in self.step_seconds]
        return replay * (median(ratios) if ratios else 1.0)

    def current(self, bucket: int) -> int:
        """The depth this bucket verifies at now (not counting a step: see `depth`)."""
        return self._picked.get(bucket, self.full)

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
        seconds = {d: self.seconds(bucket, d) for d in self.depths}
        rates = {d: expected_tokens(shares, d) / t for d, t in seconds.items() if t}
        if current not in rates:
            return self.full
        best = max(rates, key=rates.get)
        return best if rates[best] > rates[current] * (1 + DEPTH_MARGIN) else current

    def info(self) -> dict:
        shares = accept_shares(self.hist, self.full, set(self._known))
        return {"depths": self.depths, "picked": {str(b): d for b, d in sorted(self._picked.items())},
                "accept_shares": [round(s, 3) for s in shares],
                "step_ms": {f"{b}x{d}": round(s * 1e3, 3)
                            for (b, d), s in sorted(self.step_seconds.items())},
                "measured_step_ms": {f"{b}x{d}": round(median(t) * 1e3, 3)
                                     for (b, d), t in sorted(self._measured.items()) if t}}


class StepTimer:
    """The seconds of overlapped speculative steps, from the times the calls that launch them
    start. Call k launches step k, then waits for step k - 1; with the device kept busy, step k
    starts as step k - 1 ends, so the calls that launch steps k + 1 and k + 2 start one step k
    apart (with the host the slower side, its work a step instead). An interval counts only
    inside one run of overlapped steps (`reset` at every flush) and within one bucket."""

    def __init__(self):
        self._launched: list = []  # (bucket, width) of the last two steps launched
        self._start: Optional[float] = None  # when the last launching call started

    def reset(self) -> None:
        self._launched, self._start = [], None

    def launched(self, now: float, bucket: int, width: int) -> Optional[tuple]:
        """A call started at `now` to launch a step of (bucket, width): (bucket, width,
        seconds) of the step the time since the call before measured, or None."""
        out = None
        if len(self._launched) == 2 and self._start is not None:
            (b0, w0), (b1, _) = self._launched
            if b0 == b1 == bucket:
                out = (b0, w0, now - self._start)
        self._launched = (self._launched + [(bucket, width)])[-2:]
        self._start = now
        return out
