"""What a switch of side costs adaptive speculation (specpcg/speculative/adaptive.py), by its
direction.

The two directions cost different things. A switch into speculation lets the draft catch up on
every position the plain steps passed (a DRAFT_EXTEND over the whole batch: 2-10 ms on an
H200 at batch 2-64, EAGLE3 at 54c6676, `probe_adaptive_steps.py`); a switch out of it only
drains the overlapped pipeline (about a plain step). One mean over both, as before, priced a
switch into speculation at half of what it cost, and a bucket that had not switched yet at
nothing: at a batch's tail, with the batch shrinking through buckets that last chose the other
side, each speculated again for a few steps after its catch-up (batch 64: 4.7 ms at 34
requests, 3.1 ms at 2, against 1.2-1.9 ms steps).

A catch-up's cost grows with the positions it covers: on an H200 (EAGLE3, 8386616) a look at
batch 64 after 94 plain steps caught up on about 6,000 positions in 15.7 ms, where the bucket's
mean switch said 9.0 ms, against 1.5 ms plain steps. So a switch into speculation whose
positions are known is priced as a line fitted over every bucket's recent catch-ups, fixed
seconds plus seconds per position (`CatchUpFit`): the longer a batch runs plain, the more its
next look costs, and where a step's positions cost more than a look may spend per step, no
wait makes a look cheap enough (adaptive.py, `look_wait`). The positions are those the draft
says it lacks (`DraftWorker.catch_up_positions`): a request's whole prompt until its first
speculative step, then each plain step. Counted as the plain steps times the batch size, a look
into a batch that had run plain steps since its prefill was priced without its prompts.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Optional

# What chose a step that switched side (info()'s "switches"): the side borrowed for the step
# after a prefill, a bucket's warm-up, a batch's tail staying on its side, a look at the other
# side (into it and back), the choice on rates (requests waiting, or shadow verifies) or on the
# finish estimate (nothing waiting), and a batch above the user's cap (AdaptiveSpeculation.skip).
SWITCH_WHY = ("borrowed", "warm-up", "tail", "look", "rates", "finish", "cap")
KEPT = 8  # switches of each direction kept per bucket (the last ones: speeds change)
KEPT_EVERYWHERE = 16  # catch-ups kept over all buckets: the fit needs positions of many sizes


class CatchUpFit(NamedTuple):
    """seconds = fixed + per_position * positions, least squares, neither below 0."""
    fixed: float
    per_position: float

    @classmethod
    def of(cls, samples) -> "CatchUpFit":
        pts = [(p, s) for s, p in samples if p is not None]
        if not pts:
            return cls(0.0, 0.0)
        n = len(pts)
        mp, ms = sum(p for p, _ in pts) / n, sum(s for _, s in pts) / n
        var = sum((p - mp) ** 2 for p, _ in pts)
        slope = sum((p - mp) * (s - ms) for p, s in pts) / var if var > 0 else 0.0
        if slope <= 0:  # one size of catch-up, or noise: its mean
            return cls(ms, 0.0)
        if ms - slope * mp < 0:  # through the origin instead
            return cls(0.0, ms / mp)
        return cls(ms - slope * mp, slope)

    def at(self, positions: float) -> float:
        return self.fixed + self.per_position * positions


class SwitchCosts:
    """Seconds a switch step took beyond the steady step after it, the last KEPT of each
    direction (keyed by the side switched into), each with the positions its catch-up covered
    (None: not known); a direction not measured here yet takes `everywhere`'s (every
    bucket's), then 0."""

    def __init__(self, everywhere: Optional["SwitchCosts"] = None, keep: int = KEPT):
        self.kept = {True: deque(maxlen=keep), False: deque(maxlen=keep)}
        self.everywhere = everywhere

    def add(self, into_spec: bool, seconds: float, positions: Optional[int] = None) -> None:
        self.kept[into_spec].append((max(seconds, 0.0), positions))
        if self.everywhere is not None:
            self.everywhere.add(into_spec, seconds, positions)

    def cost(self, into_spec: bool, positions: Optional[float] = None) -> float:
        """A switch into speculation over `positions` catch-up positions: the fit over every
        bucket's catch-ups; else the mean of the direction's kept switches, here or else
        everywhere (0: none)."""
        if into_spec and positions is not None:
            fit = self.catch_up()
            if fit.per_position > 0:
                return fit.at(positions)
        kept = self.kept[into_spec]
        if not kept and self.everywhere is not None:
            kept = self.everywhere.kept[into_spec]
        return sum(s for s, _ in kept) / len(kept) if kept else 0.0

    def catch_up(self) -> CatchUpFit:
        """The line through every bucket's recent switches into speculation."""
        pool = self.everywhere if self.everywhere is not None else self
        return CatchUpFit.of(pool.kept[True])

    def both(self) -> float:
        """A switch there and back: what a look costs in switches."""
        return self.cost(True) + self.cost(False)
