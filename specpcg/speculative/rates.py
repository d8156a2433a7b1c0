"""A side's measured speed for adaptive speculation (specpcg/speculative/adaptive.py): its
last WINDOW recorded steps, as a ratio of sums with outlying slow steps left out, and the test
that tells a look's steps are clearly slower than the chosen side's."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

WINDOW = 32  # recorded steps a side's rate is measured over
# A look this many times off its side's window restarts that window: the speed has changed
# (4x: a look of NGRAM's spans 1x-8x of its mean by chance alone, and a smaller factor let
# lucky looks cost a losing draft 2-5% in simulation).
CHANGE_FACTOR = 4.0
# A side's step time leaves out steps over OUTLIER_FACTOR times the window's median, up to one
# in TRIM_DIV: a hiccup of the host (a collection, another process, a first replay) lands on
# whichever side ran then, and one 20x step among a side's three warm-up steps (22 step
# times for 3 steps) made that side measure 7x slower until its window let the step go. Steps
# within the factor all count: trimming every window's slowest eighth moved no hiccup-free
# choice for the better in the noisy-acceptance test, only shifted both sides' times.
OUTLIER_FACTOR = 2.0
TRIM_DIV = 8
# A look confirms the choice, and the wait before the next doubles (from the wait it followed,
# LOOK_BUDGET's included), once the other side's window is full, or from batch
# CONFIRM_MIN_BATCH on as soon as its recorded steps (CONFIRM_STEPS or more) lose by CONFIRM_Z
# standard errors. Full windows alone (16 looks of 2 recorded steps) kept looking every 32
# steps through a whole run: on the Llama-3-8B shape (H200, NGRAM, random weights) 35 of 384
# steps speculated in every bucket, 0.98-0.99x no-spec. At batch 1 a step is one request's, and
# an NGRAM-like side (half its verifies accept nothing) shows runs of equal steps whose spread
# says nothing: the test shut out a speculation 1.5x faster in the noisy-acceptance test (1.05x
# of plain, against 1.44x with full windows alone). From batch 4 a step averages its requests.
CONFIRM_STEPS = 6
CONFIRM_Z = 3.0


def _ratio(steps) -> float:
    """Tokens over seconds of (tokens, seconds) steps."""
    seconds = sum(s for _, s in steps)
    return sum(t for t, _ in steps) / seconds if seconds > 0 else 0.0


@dataclass
class Rate:
    """A side's last WINDOW recorded steps. Its rate is their tokens over their seconds (a ratio
    of sums, not an average of per-step ratios: see the module docstring), the seconds without
    outlying slow steps (OUTLIER_FACTOR). The sums are kept until the window changes: a batch with
    nothing waiting asks for them once per request and step (`finish_seconds`), on the host's
    critical path. The window's step times are kept sorted, and its tokens apart, as steps come
    and go: a batch of one re-chooses on rates every step, and sorting and summing the window
    anew made its controller's choice cost a plain step 19 us more host time than a held
    engine's (EAGLE3, 2-core CPU, `probe_host_step.py --draft eagle3-adaptive`)."""
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps: int = 0
    _sums: Optional[tuple] = field(default=None, repr=False, compare=False)
    _times: list = field(default_factory=list, repr=False, compare=False)  # sorted
    _tokens: deque = field(default_factory=deque, repr=False, compare=False)  # in order

    def __post_init__(self) -> None:
        self._keep(self.recent)

    def _keep(self, recent: deque) -> None:
        self.recent, self._sums = recent, None
        self._times = sorted(s for _, s in recent)
        self._tokens = deque((t for t, _ in recent), maxlen=recent.maxlen)

    def add(self, per_req: float, seconds: float) -> None:
        if len(self.recent) == self.recent.maxlen:  # its oldest step leaves the window
            del self._times[bisect_left(self._times, self.recent[0][1])]
        self.recent.append((per_req, seconds))
        insort(self._times, seconds)
        self._tokens.append(per_req)
        self.steps += 1
        self._sums = None

    def _totals(self) -> tuple:
        """(tokens, seconds, steps) over the window; seconds as steps times the mean step
        without outliers (OUTLIER_FACTOR), so a rare slow step does not decide the side."""
        if self._sums is None:
            times, n = self._times, len(self._times)
            slow = n - bisect_right(times, OUTLIER_FACTOR * times[n // 2]) if n >= 3 else 0
            kept = n - min(slow, -(-n // TRIM_DIV))
            seconds = sum(times[:kept]) * n / kept if kept else 0.0
            self._sums = (sum(self._tokens), seconds, n)
        return self._sums

    @property
    def tok_s(self) -> float:
        """Tokens per second per request."""
        tokens, seconds, _ = self._totals()
        return tokens / seconds if seconds > 0 else 0.0

    def clearly_slower(self, rate: float) -> bool:
        """Whether this side's recorded steps (at least CONFIRM_STEPS) run slower than `rate`
        (tokens per second per request: the chosen side's) by more than their spread explains:
        per step, its tokens less those `rate` emits in its seconds, CONFIRM_Z standard errors
        below zero."""
        n = len(self.recent)
        if n < CONFIRM_STEPS or rate <= 0:
            return False
        gains = [t - rate * s for t, s in self.recent]
        mean = sum(gains) / n
        var = sum((g - mean) ** 2 for g in gains) / (n - 1)
        return mean + CONFIRM_Z * (var / n) ** 0.5 < 0

    def restart_if_changed(self, last: int) -> None:
        """After a look: when its `last` steps ran CHANGE_FACTOR times slower or faster than the
        window says, the side's speed has changed (other prompts), and only they are kept."""
        if len(self.recent) <= last:
            return
        look = list(self.recent)[-last:]
        if not self.tok_s / CHANGE_FACTOR <= _ratio(look) <= CHANGE_FACTOR * self.tok_s:
            self._keep(deque(look, maxlen=WINDOW))

    @property
    def step_s(self) -> float:
        """Seconds per step."""
        _, seconds, n = self._totals()
        return seconds / n if n else 0.0

    @property
    def per_req(self) -> float:
        """Tokens per request per step (a speculative step's accept length)."""
        tokens, _, n = self._totals()
        return tokens / n if n else 0.0

    def far_behind(self, rate: float) -> bool:
        """A bucket's own window confirms a look only when full (`PlacedRate.far_behind`
        says why a stretch of a batch of one may sooner)."""
        return False

    def step_ms(self) -> list:
        """The window's step times in ms, least, median and most ([] before a step): what a
        cold start or a switch left in it, which the rate's trim of slow steps may keep."""
        times = self._times
        picks = (times[0], times[len(times) // 2], times[-1]) if times else ()
        return [round(1e3 * t, 3) for t in picks]


# A batch of one's accept length at a stretch of its output is its own steps' there, shrunk
# toward every stretch's by this many steps' worth (`PlacedRate`). Simulated at batch 1
# (`sim_adaptive.py --batches 1 [--growth] [--unplaced]`, accept chances 0.05-0.7, spreads 0 and
# 0.1, 12 seeds, both rate sets; `sim_adaptive_place_*.jsonl`): 4 followed acceptance rising
# along the answer best and lost up to 5% elsewhere on stretches' few noisy steps; 1,000 (every
# stretch alike) is the position-blind rate. 16: steady acceptance 0.964-0.967 of the faster
# pinned side on average (0.969 blind), rising 0.982-0.983 (0.941-0.946 blind), its worst cell
# 0.95 (0.84 blind).
PLACE_PRIOR_STEPS = 16


# A look at a stretch also confirms plain steps once every stretch's window holds
# FAR_MIN_STEPS steps and the stretch's rate (its few steps shrunk toward every stretch's) is
# FAR_BEHIND times slower than plain steps' (`PlacedRate.far_behind`): a draft that never pays
# looked at a stretch or two in every answer until each stretch's own window was full (32
# steps, two a look). A draft whose acceptance rises along an answer is not that far behind at
# first: the default command's STANDALONE draft's first stretch took 1.5 tokens a verify where
# a verify paid from 1.9 (1.27x). Simulated at batch 1 (`sim_adaptive.py --batches 1 --alphas
# 0.05 0.3 0.5 0.7 --spreads 0 0.1 --seeds 12 [--growth]`, both rate sets): at accept chance
# 0.05 0.964 -> 0.973-0.982 of the faster pinned side, at 0.3 0.963-0.972 -> 0.964-0.974, the
# other cells unchanged; tests/test_adaptive.py's noisy side, placed, 1.477x -> 1.471x.
FAR_BEHIND = 1.5
FAR_MIN_STEPS = 6


class PlacedRate:
    """A batch of one's speculative rate at one stretch of its output (bucket.place_of): the
    stretch's own recorded steps' accept length, shrunk toward every stretch's
    (PLACE_PRIOR_STEPS), over every stretch's step time: a verify costs the same anywhere in an
    answer, while what it accepts changes along it. A stretch no step has measured takes every
    stretch's rate: it costs no warm-up of its own, and the looks measure it. The window that
    prices a look and tells when one confirms the choice is the stretch's own: a stretch no
    step has measured prices a look's steps there at nothing (its catch-up still counts; where
    that puts the look past the stretch's end, it comes at once: `Bucket.place_unmeasured`),
    and a look confirms nothing until the stretch's window is full, so a batch of one looks at
    each stretch it knows little of.
    NOTE: with every stretch's window (9af5bfc) the looks confirmed on steps from the answers'
    starts and spaced out: the default command's STANDALONE draft at batch 1 ran 0.91x no-spec
    (0.91 / 0.44 / 1.24 by round), where with the stretch's own it ran 1.24x, 1.28x and 1.26x
    in three runs (every round 1.17x or more; H200, 4649a57). The own window's extra looks
    cost an untrained EAGLE3 head 0.92x against 0.94x blind to the place (4649a57), about what
    they cost it at 9af5bfc (0.95x against 0.96x)."""

    def __init__(self, pooled: Rate):
        self.own, self.pooled = Rate(), pooled

    @property
    def recent(self) -> deque:
        return self.own.recent

    @property
    def steps(self) -> int:
        return self.pooled.steps

    def add(self, per_req: float, seconds: float) -> None:
        self.own.add(per_req, seconds)
        self.pooled.add(per_req, seconds)

    @property
    def per_req(self) -> float:
        n, prior = len(self.own.recent), PLACE_PRIOR_STEPS
        return (self.own.per_req * n + self.pooled.per_req * prior) / (n + prior)

    @property
    def step_s(self) -> float:
        return self.pooled.step_s

    @property
    def tok_s(self) -> float:
        step = self.step_s
        return self.per_req / step if step > 0 else 0.0

    def clearly_slower(self, rate: float) -> bool:
        return self.own.clearly_slower(rate)

    def restart_if_changed(self, last: int) -> None:
        self.own.restart_if_changed(last)

    def far_behind(self, rate: float) -> bool:
        """Whether every stretch's window holds FAR_MIN_STEPS steps and this stretch runs
        FAR_BEHIND times slower than `rate` (tokens per second per request: plain steps')."""
        return len(self.pooled.recent) >= FAR_MIN_STEPS and self.tok_s * FAR_BEHIND < rate
