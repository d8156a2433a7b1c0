"""The decode steps' clock for adaptive speculation (specpcg/speculative/adaptive.py): each
step's seconds, as the scheduler hands them to the controller.

Both kinds of step end in a read of their tokens, so they are timed alike, from the end of the
decode step before (the call's start after a prefill): the host's work between two steps is the
step's too (with overlap it runs while the device computes; a call timed alone left it out, the
more so for the side that hands back more tokens a step). A call that only launched its step
leaves the clock as it was, so the switch step carries the launch: timed from the launch,
switches looked free (H200, NGRAM at batch 64: 6 looks in 128 steps, 0.90x no-spec,
probe_adaptive_steps.py). A switch reads the other side's step in flight first: that step goes
to the controller as flushed (`AdaptiveSpeculation.flushed`), and the clock restarts there.
"""

from __future__ import annotations

import time


class StepClock:
    def __init__(self, scheduler):
        self.scheduler = scheduler  # its `adaptive` (a controller, or None) is told each step
        self.last_end = None  # when the last decode step returned (None: a prefill since)
        self.launched_only = False  # the last overlapped call resolved no step

    def prefill(self) -> None:
        """A prefill ran: the next step is timed from its own call's start, and is no step's
        speed for the controller."""
        self.last_end = None
        if self.scheduler.adaptive is not None:
            self.scheduler.adaptive.interrupt()

    def step_done(self) -> None:
        """A decode call returned: the next step is timed from here, unless it only launched."""
        if not self.launched_only:
            self.last_end = time.perf_counter()
        self.launched_only = False

    def record(self, batch_size: int, speculated: bool, tokens: int, start: float) -> None:
        """A step that resolved `tokens`, its call started at `start` (module docstring)."""
        adaptive = self.scheduler.adaptive
        if adaptive is None:
            return
        if self.last_end is not None:
            start = min(start, self.last_end)
        adaptive.record(batch_size, speculated, tokens, time.perf_counter() - start)

    def flushed(self, speculated: bool, carried: list, before: int) -> None:
        """A switch just read the other side's step in flight, which carried `carried` (their
        outputs held `before` tokens): timed from the decode step before it."""
        if self.last_end is None:  # a prefill since: not a step's speed
            return
        now = time.perf_counter()
        adaptive = self.scheduler.adaptive
        if adaptive is not None:
            tokens = sum(len(r.output_ids) for r in carried) - before
            adaptive.flushed(len(carried), speculated, tokens, now - self.last_end)
        self.last_end = now
