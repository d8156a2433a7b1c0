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
"""

from __future__ import annotations

from collections import deque
from typing import Optional

KEPT = 8  # switches of each direction kept per bucket (the last ones: speeds change)


class SwitchCosts:
    """Seconds a switch step took beyond the steady step after it, the last KEPT of each
    direction (keyed by the side switched into); a direction not measured here yet takes
    `everywhere`'s (every bucket's), then 0."""

    def __init__(self, everywhere: Optional["SwitchCosts"] = None):
        self.kept = {True: deque(maxlen=KEPT), False: deque(maxlen=KEPT)}
        self.everywhere = everywhere

    def add(self, into_spec: bool, seconds: float) -> None:
        self.kept[into_spec].append(max(seconds, 0.0))
        if self.everywhere is not None:
            self.everywhere.add(into_spec, seconds)

    def cost(self, into_spec: bool) -> float:
        """The mean of the direction's kept switches, here or else everywhere (0: none)."""
        kept = self.kept[into_spec]
        if not kept and self.everywhere is not None:
            kept = self.everywhere.kept[into_spec]
        return sum(kept) / len(kept) if kept else 0.0

    def both(self) -> float:
        """A switch there and back: what a look costs in switches."""
        return self.cost(True) + self.cost(False)
