"""A batch-size bucket's measures for adaptive speculation (specpcg/speculative/adaptive.py):
each side's rate, the looks at the side not chosen and what they may cost, the switches, and
the choice between the sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specpcg.speculative.finish import Finish, finish_seconds
from specpcg.speculative.rates import PlacedRate, Rate
from specpcg.speculative.switches import SwitchCosts

EXPLORE_EVERY = 32  # then EXPLORE_STEPS steps of the slower side after this many (first wait)
EXPLORE_STEPS = 3  # the first of them is a switch, not recorded
# The longest wait between two looks. A look into speculation from plain steps costs the draft's
# catch-up (about 4 ms on an H200: probe_catchup.py), 1,024 batch-1 steps of the default model
# about 144 ms there. Simulated over 20 batches each (`sim_adaptive.py --catch-up 3.8 0.7 --rates
# h200-weak-eagle3`, 38 cells of alphas 0.05-0.7, 3 seeds), 4,096 ran 0.9779 of the faster
# pinned side on average against 0.9752 (better in 27 cells, 0.15% worse in one; an untrained
# head at batch 1: 0.989 against 0.981), with shadow verifies 0.9795 against 0.9731 (32 cells).
# In steps a request's turnover is alike at every batch size: 4,096 is 8 answers of 512 tokens.
EXPLORE_MAX_EVERY = 4096
# The other side must be this much faster to take over: where the two measure alike, flipping
# on noise costs a slow step per switch (NGRAM at batch 64 on the H100 ran 0.75x no-spec with
# its two rates 7% apart and about half of its steps on each side).
SWITCH_MARGIN = 0.05
# Looks cost at most this share of the time (their switches: switches.py). With a look every 32
# steps, EAGLE3 (7, 1, 8) ran adaptive at 0.85 / 0.77x no-spec at batch 16 / 64 where pinned
# ran 0.94 / 0.90x (H100, 73d57f9); with this budget, 0.87 / 0.87x against 0.98 / 0.89x
# (53c19ec). 1% won 1-4% in simulation, failed the noisy-side test, gained nothing on an H200.
LOOK_BUDGET = 0.03
# A look pays only if the other side may have overtaken, so its budget is all of LOOK_BUDGET
# while the chosen side leads by at most LOOK_CLOSE, and shrinks in proportion to a larger lead
# once a look has confirmed it (`look_share`): a side far behind is unlikely to catch up between
# two looks. With the whole budget whatever the lead, a head that never paid cost its engine
# about 3% (H200, EAGLE3 and NEXTN at batch 16 and 64, 388d735: each round of bench_adaptive
# with a look ran 3-6% below the rounds without one, as fast as an engine held to plain steps).
LOOK_CLOSE = 0.10
# Into speculation from plain steps, speculation need only come within this much of plain
# steps' speed, not SWITCH_MARGIN faster, where a draft catches up to switch (not NGRAM's shadowed
# buckets). A look from plain steps costs the draft's catch-up on every prompt and plain position
# (an eager forward, 3-6 ms on an H200 at batch 16-64: benchmarks/probe_catchup.py), a look from
# speculation a switch and the look's own few positions. So in a near-tie speculation is the
# cheaper side to stay on: on an H200, EAGLE3 heads that tied plain steps ran bench_adaptive's
# mostly speculating rounds at no-spec's speed and its mostly plain rounds, with a look, 5% below
# (800b3e5). With this margin such a head ran 0.993x no-spec over 8 cells of two runs, against
# 0.971x with SWITCH_MARGIN side by side (H200, 5276c67, README). Simulated (H200 weak-head
# rates, 60 cells): 0.977 -> 0.980 of the faster pinned side; with shadow verifies it lost.
SPEC_HOME = 0.03
# A look's wait, once past its bucket's explore_every, is priced again (look_wait: the windows'
# sums, and the draft's lag) when it comes due or this many steps after it was last priced, not
# every step: priced every step, the choice took a fifth of a plain step's host work at batch
# 16 (no-op graph steps of a tiny model, `probe_host_step.py --draft adaptive --profile`),
# half of it this pricing. A look then comes at most this many steps after a wait that shrank
# between two pricings.
LOOK_PRICED_EVERY = 8
# From batch 2, a wait is priced again LOOK_PRICED_AHEAD of the way to when it comes due (at
# least LOOK_PRICED_EVERY steps on): a few dozen pricings a wait of thousands of steps, not
# hundreds. At batch 64 the default model's step waits on the host (docs/PERFORMANCE.md), and a
# plain engine's controller priced its look's wait every 8 steps for the whole 4,096 (2-core
# CPU, `probe_controller_host.py`, 18c607b). Simulated (`sim_adaptive.py`, 32 cells, 6 seeds,
# with REDECIDE_MAX_EVERY's 256), adaptive ran 0.9826 of the faster pinned side, as before;
# priced only when due, a batch-1 cell lost 3% (0.946 -> 0.912): a batch of one keeps
# LOOK_PRICED_EVERY.
LOOK_PRICED_AHEAD = 0.5
# With nothing waiting, the side is re-chosen on the finish estimate every REDECIDE_EVERY steps
# (and after every look), not every step: the estimate walks every running request. A re-choice
# that keeps the side, ahead by more than SETTLED_LEAD, doubles the wait (up to
# REDECIDE_MAX_EVERY); any other, a look's end or a batch arriving resets it. At batch 64 the
# default model's step waits on the host: in a logged run (probe_adaptive_steps.py, H200)
# every 8th step's host gap was 250 us against 80-90 (a no-spec engine's: 51), and with plain
# steps 25-30% ahead the adaptive engine ran them at 0.97-0.98x no-spec. With the longest wait
# 32, a settled batch of 64 still spent 2.5-3.1 ms of its 237 steps in the controller on a
# 2-core CPU; with 256 (and LOOK_PRICED_AHEAD) 0.9 ms (`probe_controller_host.py`). Simulated
# (32 cells, 6 seeds): 0.9826 of the faster pinned side either way; a batch moving into
# another bucket still re-chooses at once. A bucket that shadow verifies price never doubles
# the wait: they measure the draft on every step, and acceptance drifts along an answer.
# Simulated with acceptance rising along each answer (`sim_adaptive.py --shadow
# --shadow-finish 32 --growth`, 24 cells), 1.010 of the faster pinned side without the doubling
# against 0.998 (worst cell 0.972 against 0.953); steady, 0.998 against 0.995. On an H100 NGRAM
# on chat prompts ran as before (docs/PERFORMANCE.md, "Shadow-priced choices").
REDECIDE_EVERY = 8
REDECIDE_MAX_EVERY = 256
SETTLED_LEAD = 0.20
# From plain steps that lead speculation by more than RATES_LEAD, rates alone are compared
# again after RATES_EVERY steps (`Bucket.by_rates`), so a switch into speculation comes at most
# that many steps late. A batch of one's choice then costs a plain step 4 us of host work more
# than a held engine's, against 8 (a random EAGLE3 head, 2-core CPU, `probe_host_step.py`:
# docs/PERFORMANCE.md). Simulated at batch 1 (`sim_adaptive.py --batches 1 --seeds 24`, six
# rate and acceptance sets) every cell ran as before but 5 of 8 with hiccups, which gained up
# to 0.5%. In a closer race a plain step of noise may decide, and waiting reshuffled which:
# the noisy-side test's 60 seeds ran 1.396x against 1.407x.
RATES_EVERY = 8
RATES_LEAD = 0.25
# A batch of one measures speculation per stretch of its request's output: its first
# PLACE_TOKENS tokens, then stretches twice as long as the one before (`place_of`).
PLACE_TOKENS = 16


@dataclass
class Bucket:
    spec: Rate = field(default_factory=Rate)
    decode: Rate = field(default_factory=Rate)
    since_explore: int = 0
    # (the side chosen, since_explore): below it a look is not due, as last priced on that side
    # (AdaptiveSpeculation._look_due, LOOK_PRICED_EVERY)
    look_priced: tuple = (None, 0)
    explore_left: int = 0  # steps of a look still to run, on the side other than explored_from
    explore_every: int = EXPLORE_EVERY  # steps between two looks at the slower side
    explored_from: Optional[bool] = None  # the choice before the look in progress or just run
    spec_chosen: Optional[bool] = None  # the side chosen last (not counting looks)
    # Steps since the last choice on a finish estimate (at first: due at once, whatever the
    # controller's REDECIDE_EVERY).
    since_finish: int = 1 << 30
    redecide_every: int = 0  # steps between two such choices (0: REDECIDE_EVERY)
    # Seconds a switch step took beyond the steady step after it, by direction (switches.py).
    switches: SwitchCosts = field(default_factory=SwitchCosts)
    # (speculative, plain) seconds to finish the batch at the last choice that estimated them,
    # the switch included (probe_adaptive_steps.py logs them).
    last_finish: Optional[tuple] = None
    # The running batch's accept length by shadow verifies (specpcg/speculative/shadow.py), as
    # of this bucket's step; None: not measured that way.
    shadow: Optional[float] = None
    look_close: float = LOOK_CLOSE  # the controller's (AdaptiveSpeculation.look_close)
    # With shadow verifies, the side not chosen is looked at as a bucket without them would
    # while it holds fewer recorded steps than this (0: never; AdaptiveSpeculation's). NOTE: an
    # H200 pass of NGRAM at batch 64 priced plain steps on its warm-up's 5 (median 1.496 ms,
    # where other passes measured 1.21-1.35 ms) for all its batches, since such a bucket looks
    # every EXPLORE_MAX_EVERY steps (docs/PERFORMANCE.md).
    relook_below: int = 0
    into_spec: float = -SPEC_HOME  # the controller's (AdaptiveSpeculation.into_spec)
    # A batch of one's speculative rate per stretch of its output (`place`), and every
    # stretch's steps together (the bucket's own rate before its first place).
    places: dict = field(default_factory=dict)
    every_place: Optional[Rate] = None
    # (the speculative rate compared, plain steps before the next comparison) (`by_rates`)
    rates_wait: tuple = (None, 0)
    place_left: int = 0  # a batch of one's output tokens to the end of its stretch (`place`)

    def place(self, position: int) -> None:
        """Speculation's rate from this step on is that of the stretch of output `position` (a
        batch of one's output tokens so far) falls in (specpcg/speculative/adaptive.py)."""
        if self.every_place is None:
            self.every_place = self.spec
        key = place_of(position)
        if key not in self.places:
            self.places[key] = PlacedRate(self.every_place)
        if self.spec is not self.places[key]:  # another stretch: its look not priced yet
            self.spec, self.look_priced = self.places[key], (None, 0)
        self.place_left = (PLACE_TOKENS << key) - position

    def place_unmeasured(self, wait: float) -> bool:
        """Whether a look `wait` plain steps off would come after this stretch of a batch of
        one's output ends, where speculation has no step of its own and, as every stretch
        measures it, is not far behind plain steps (PlacedRate.far_behind): then the look
        comes now (AdaptiveSpeculation._look_due). A draft that never pays is far behind once
        every stretch holds FAR_MIN_STEPS steps: it pays such looks at a stretch or two in an
        engine's life. NOTE: without them a trained EAGLE3 head never looked past its answers'
        starts, where it accepts least: its first catch-up (10.3 ms, later ones 1.4) put the
        next look about 700 steps off, and the engine decoded plain at 0.99x no-spec where
        pinned speculation ran 1.40x (H100, 23a4281, docs/PERFORMANCE.md)."""
        return (self.every_place is not None and wait > self.place_left
                and not self.spec.recent and not self.spec.far_behind(self.decode.tok_s))

    def side(self, spec: bool) -> Rate:
        """The speculative side's rate, or the plain one's."""
        return self.spec if spec else self.decode

    @property
    def shadowed(self) -> bool:
        """Whether shadow verifies measure the speculative side's accept length: then a
        speculative step's tokens come from them, its seconds from its own steps, and the bucket
        looks only every EXPLORE_MAX_EVERY steps (what a look still measures is a step's time,
        which a look of 3 steps in 1,024 keeps current), or sooner (`relook_below`)."""
        return self.shadow is not None

    def per_req(self, spec: bool) -> float:
        """Tokens per request a step of a side emits (a speculative step's accept length)."""
        if spec and self.shadowed:
            return self.shadow
        return self.side(spec).per_req

    def tok_s(self, spec: bool) -> float:
        """A side's tokens per second per request."""
        if spec and self.shadowed:
            step = self.spec.step_s
            return self.per_req(True) / step if step > 0 else 0.0
        return self.side(spec).tok_s

    def report(self, spec_steps: int, decode_steps: int, switches: dict) -> dict:
        """AdaptiveSpeculation.info's line for this bucket: each side's tok/s per request, the
        steps it ran, its window's least, median and most step time (ms), and the switches."""
        return {"spec_tok_s_per_req": round(self.tok_s(True), 2),
                "decode_tok_s_per_req": round(self.tok_s(False), 2),
                "spec_steps": spec_steps,
                "shadow_tokens_per_verify": (round(self.per_req(True), 3)
                                             if self.shadowed else None),
                "decode_steps": decode_steps,
                "spec_step_ms": getattr(self.spec, "pooled", self.spec).step_ms(),
                "decode_step_ms": self.decode.step_ms(), "switches": switches}

    def look_every(self, spec: bool, batch_size: int) -> float:
        """Steps of the chosen (`spec`) side between two looks at the other."""
        if self.shadowed and len(self.side(not spec).recent) >= self.relook_below:
            return EXPLORE_MAX_EVERY
        return max(self.explore_every, self.look_wait(spec, batch_size))

    def look_wait(self, spec: bool, batch_size: int, behind: Optional[int] = None) -> float:
        """Steps of the chosen (`spec`) side between two looks so that a look costs at most
        LOOK_BUDGET of the time: its two switches, as measured, and its EXPLORE_STEPS steps of
        the other side, each losing what that step's tokens would have cost on the chosen one.
        From plain steps the switch into speculation catches up on every position the wait
        passed (switches.py): each step of the wait adds its share of the look's cost, and
        where that share is past the budget no wait is long enough. behind: from plain steps,
        the positions a look now would catch up on (prompts included): the wait is then the
        steps whose budget pays for that look."""
        side, other = self.side(spec), self.side(not spec)
        rate = self.tok_s(spec)
        if side.step_s <= 0 or rate <= 0:
            return 0.0
        slower = max(other.step_s - self.per_req(not spec) / rate, 0.0) if other.recent else 0.0
        fit, grows = self.switches.catch_up(), 0.0
        if fit.per_position <= 0:  # not known by positions: the mean switch
            into = self.switches.cost(True)
        elif spec:  # back into speculation after the look's own plain steps
            into = fit.at(EXPLORE_STEPS * batch_size)
        elif behind is not None:  # the lag now: the wait's positions are in it
            into = fit.at(behind)
        else:
            into, grows = fit.fixed, fit.per_position * batch_size
        budget = LOOK_BUDGET * self.look_share(spec) * side.step_s - grows
        if budget <= 0:
            return EXPLORE_MAX_EVERY
        return min((into + self.switches.cost(False) + EXPLORE_STEPS * slower) / budget,
                   EXPLORE_MAX_EVERY)

    def look_share(self, spec: bool) -> float:
        """The share of LOOK_BUDGET a look at the other side may cost (LOOK_CLOSE), once a
        look has confirmed the choice: a warm-up's few noisy steps must not put off the first
        look at a side that only seemed far behind."""
        lead = self.lead(spec) if self.explore_every > EXPLORE_EVERY else 0.0
        return 1.0 if lead <= self.look_close else self.look_close / lead

    def lead(self, spec: bool) -> float:
        """How much faster the chosen (`spec`) side is, as the last choice compared them: by
        the finish estimate where it made one, else by rates; 0 where the other is unmeasured."""
        if self.last_finish is not None:
            spec_time, plain_time = self.last_finish
            mine, other = (spec_time, plain_time) if spec else (plain_time, spec_time)
            return other / mine - 1.0 if mine > 0 else 0.0
        mine, other = self.tok_s(spec), self.tok_s(not spec)
        return mine / other - 1.0 if other > 0 else 0.0

    def finish_keeps(self, spec: bool) -> bool:
        """Whether the finish estimate made for this step keeps `spec`'s side by more than
        SWITCH_MARGIN. NOTE: a look was confirmed only by per-request rates; where those tie and
        the straggler decides the finish (EAGLE3 at batch 64 on an H200), no look confirmed and
        one came every 32 steps: 0.949 of the faster side at batch 16 in simulation, 0.972."""
        return self.last_finish is not None and self.lead(spec) > SWITCH_MARGIN

    def prefer_spec(self, finish: Optional[Finish], step_s, accepts=(),
                    current: Optional[bool] = None, behind: Optional[int] = None) -> bool:
        """The faster side (per request; with `finish`, the one that ends the batch sooner,
        a step of b requests taking step_s(spec, b) seconds); the side running now (`current`,
        else the side chosen last) keeps its place unless the other is faster by SWITCH_MARGIN
        (each switch costs a slow step, switches.py; into speculation, a catch-up over `behind`
        positions), or, into speculation, within SPEC_HOME of plain steps where a draft catches
        up (`_into_spec_margin`). NOTE: a batch shrinking into a bucket that last chose the
        other side compared from that side: its switch went unpriced."""
        if current is not None and self.spec_chosen is not None:  # not its first choice
            self.spec_chosen = current
        spec, plain = self.tok_s(True), self.tok_s(False)
        if finish is not None and self.spec.step_s > 0 and self.decode.step_s > 0:
            spec_time = finish_seconds(finish.spec_steps_each(self.per_req(True), accepts),
                                       _per_bucket(lambda b: step_s(True, b)))
            plain_time = finish_seconds(list(finish.remaining),
                                        _per_bucket(lambda b: step_s(False, b)))
            # Going over costs a switch: near the end, flipping cost more than it won.
            if self.spec_chosen is True:  # the other side is switched into
                plain_time += self.switches.cost(False)
            elif self.spec_chosen is False:
                spec_time += self.switches.cost(True, behind)
            self.last_finish = (spec_time, plain_time)
            spec, plain = 1.0 / max(spec_time, 1e-9), 1.0 / max(plain_time, 1e-9)
        return self._pick(spec, plain)

    def _pick(self, spec: float, plain: float) -> bool:
        """The side by the two speeds (prefer_spec's margins), kept as the bucket's choice."""
        if self.spec_chosen is None:
            self.spec_chosen = spec >= plain
        elif self.spec_chosen and plain > spec * (1 + SWITCH_MARGIN):
            self.spec_chosen = False
        elif not self.spec_chosen and spec > plain * (1 + self._into_spec_margin()):
            self.spec_chosen = True
        return self.spec_chosen

    def by_rates(self, arrived: bool) -> bool:
        """prefer_spec on rates alone (no finish estimate). From plain steps it is asked every
        RATES_EVERY steps, and at once where this step's batch came from another bucket
        (`arrived`), a look just ended, the stretch of a batch of one's output changed (`place`)
        or shadow verifies price speculation: the speculative rate stands still while plain
        steps run, and the plain one moves by a step of WINDOW. Asked every step, the comparison
        was half of what choosing cost a batch of one's plain step on the host."""
        rate, wait = self.rates_wait
        if (wait and rate is self.spec and self.spec_chosen is False and not arrived
                and self.explored_from is None and not self.shadowed):
            self.rates_wait = (rate, wait - 1)
            return False
        spec, plain = self.tok_s(True), self.tok_s(False)
        first = self.spec_chosen is None  # chosen by the faster side, not the margins
        choice = self._pick(spec, plain)
        far = not (first or choice) and spec * (1 + RATES_LEAD) < plain
        self.rates_wait = (self.spec, RATES_EVERY - 1 if far else 0)
        return choice

    def from_plain(self, finish: Finish, step_s, accepts, behind: int) -> bool:
        """prefer_spec as if from plain steps, speculation paying the draft's catch-up over
        `behind` positions (the step after a prefill: adaptive.py, `_after_prefill`)."""
        self.spec_chosen, self.since_finish = False, 1
        return self.prefer_spec(finish, step_s, accepts, None, behind)

    def _into_spec_margin(self) -> float:
        """How much faster than plain steps speculation must be to switch into it."""
        return SWITCH_MARGIN if self.shadowed else self.into_spec


def _per_bucket(step_s):
    """step_s(b), asked once per batch-size bucket: finish_seconds asks for every size the
    batch shrinks through, and the answer depends only on the size's bucket."""
    known: dict = {}

    def ask(size: int) -> float:
        key = bucket_of(size)
        if key not in known:
            known[key] = step_s(size)
        return known[key]
    return ask


def measured_step_s(buckets: dict, spec: bool, batch_size: int, current: Bucket) -> float:
    """A step's seconds at `batch_size` on one side (the finish estimate's price): its own
    bucket's measure, else the nearest bucket above that measured the side (a step of more
    requests costs no less), brought down toward the nearest measure below where there is one
    (`_between`); with none above, the current bucket's. NOTE: with its own bucket's or else the
    current one's, NGRAM at batch 64 priced the straggler's speculative steps at 1-4 requests, a
    side those buckets never measured, as steps of 64 (1.71 ms, where bucket 8 measured 0.91):
    the steps pinned speculation took then cost 0.334 s against 0.291 run (H100, 3ca0b67)."""
    key = bucket_of(batch_size)
    above = _nearest(buckets, spec, key, up=True)
    if above is None:
        return current.side(spec).step_s
    below = _nearest(buckets, spec, key, up=False) if above[0] != key else None
    return above[1] if below is None else _between(below, above, key)


def _nearest(buckets: dict, spec: bool, key: int, up: bool):
    """(bucket, step seconds) of the nearest bucket from `key` (itself included), up or down,
    that measured the side; None if none did."""
    top = max(buckets, default=0)
    while 0 < key <= top:
        rate = buckets[key].side(spec) if key in buckets else None
        if rate is not None and rate.recent:
            return key, rate.step_s
        key = key << 1 if up else key >> 1
    return None


def _between(below: tuple, above: tuple, key: int) -> float:
    """A price at bucket `key` between two measured buckets, linear in the buckets' log: a GPU
    step's seconds are flat over small batches and rise over large ones, so this line lies above
    them. NOTE: a batch of 64 after batches of one (NGRAM on chat prompts, H100, c1a2a8b,
    bench_alone.py) measured speculative steps at 1 (0.59 ms) and 64 (1.69) only; priced at 64's,
    the straggler's tail at 2-32 requests cost up to twice what pinned speculation measured there
    (0.88-1.28 ms at 3ca0b67), and every step of four timed batches ran plain: 0.97x no-spec
    where pinned speculation ran 1.13x."""
    (k0, s0), (k1, s1) = below, above
    steps_up = key.bit_length() - k0.bit_length()  # doublings from the measure below
    return s0 + (s1 - s0) * steps_up / (k1.bit_length() - k0.bit_length())


def place_of(position: int) -> int:
    """The stretch of an output a position falls in: 0 for its first PLACE_TOKENS tokens, then
    one more at each doubling."""
    return (position // PLACE_TOKENS).bit_length()


def bucket_of(batch_size: int) -> int:
    """The smallest power of two >= batch_size."""
    return 1 << max(batch_size - 1, 0).bit_length()


