"""Adaptive speculation: per running-batch size, speculate only where it pays.

A speculative step verifies N tokens per request to emit its accept length; at batch 1 that is
nearly free, at batch 64 a verify is a 64 x N-row forward that can cost more than the tokens it
yields. Which side of that line a batch size falls on depends on the model, the GPU, the draft
and the prompts, so the engine measures it: for each batch-size bucket (powers of two) it keeps
the emitted tokens per second of speculative steps and of plain decode steps, and runs the
faster. Each side is tried WARMUP_STEPS times before the first choice, and the slower side
again for EXPLORE_STEPS steps after EXPLORE_EVERY steps, so a choice follows the prompts as they
change. Each look that confirms the choice doubles the wait before the next (up to
EXPLORE_MAX_EVERY); a look that overturns it resets the wait: a steady gap costs ever fewer
steps of the slower side, and a look waits long enough that it costs at most LOOK_BUDGET of the
time (its switches as measured, and its steps on the slower side: NGRAM at batch 1 on the H100
spent about a tenth of its steps in looks at 0.6x the plain rate, and ran 0.94x no-spec). The
side in use keeps its place unless the other is SWITCH_MARGIN faster.

Only steady-state steps count: the first step after a switch of side, and the first after a
prefill, are not recorded; nor is an overlapped plain call that only launched its step. A step
after a prefill, never measured, takes the nearest bucket's choice (`_borrowed`). A switch
costs what switches.py says, kept per direction. Counting those switches made speculation at
batch 1 look 0.57x as fast as it runs (H100, EAGLE3: 563 tok/s measured against 995 pinned);
counting the step after a prefill (its draft catching up on whole prompts) made EAGLE3 at batch
16 run plain steps at 0.83x no-spec where pinned speculation ran 1.31x (H100, 4a5cc11).

Rates are per request (tokens per second per running request): a bucket spans batch sizes a
factor of two apart, and as requests finish a batch shrinks through it, so the side measured
first measured at the larger batch. Counting tokens of the whole batch made NGRAM and EAGLE3
speculate at batch 64 (the warm-up speculates first) where plain steps ran 1.3x faster (H100:
an NGRAM engine held to plain steps matched a no-spec engine, 14.5-16.2k against 14.7k tok/s,
while the adaptive one ran 0.6-0.7x).

With requests waiting, the engine maximises throughput: the faster side per request. With
none waiting, the running batch is all there is, and it ends with its slowest request. A
speculative step then helps only as much as it advances that request, since the tokens it gives
the others early do not shorten the batch: a batch thinned by uneven acceptance runs its last
steps nearly as slowly as a full one. So the engine compares the time to finish the batch
(`Finish`): plain steps take max(remaining) steps; speculative ones max(remaining / accept
length) of each request's own accept length so far. NGRAM at batch 64 (H100, 20d835f)
measured 11% faster per request speculating, yet pinned speculation ran 0.81x no-spec.
Each side's time to finish counts the batch shrinking as its requests finish (finish.py).

A side's rate is the ratio of its tokens to its seconds over its last WINDOW steps. An
average of per-step rates, as before, let a noisy side lose for good: NGRAM accepts nothing on
one verify and seven drafts on the next, and the side not chosen keeps the value it had when it
lost, which is more often a low one. Simulated at batch 1 with speculation 1.5x faster on
average, that controller ran 1.10x (1.02x at worst); with windows 1.39x (1.11x at worst).
For the same reason the wait between looks grows only once the other side's window is full,
or, from batch CONFIRM_MIN_BATCH on, once its steps lose by more than their own spread.

NGRAM needs no looks to know its accept length: shadow verifies price its speculative side
(specpcg/speculative/shadow.py says how, and why on rates alone).

Both sides emit the target's own tokens (greedy: the same tokens, whichever runs), so the
choice changes speed only. A plain decode step still hands the target's hidden states to the
draft (`DraftWorker.absorb`), which catches up on them at its next round.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from specpcg.speculative.finish import (KEPT_ACCEPTS, Finish, ends_within, finish_seconds,
                                        finished_accept)
from specpcg.speculative.rates import WINDOW, Rate
from specpcg.speculative.switches import KEPT_EVERYWHERE, SwitchCosts

WARMUP_STEPS = 3  # steps of each side per bucket before choosing
EXPLORE_EVERY = 32  # then EXPLORE_STEPS steps of the slower side after this many (first wait)
EXPLORE_STEPS = 3  # the first of them is a switch, not recorded
EXPLORE_MAX_EVERY = 1024
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
# From this batch on a look may confirm early (specpcg/speculative/rates.py, `CONFIRM_Z`).
CONFIRM_MIN_BATCH = 4
# With nothing waiting and at most this many tokens left to any request, a bucket not measured
# yet is not warmed up (its batch stays on its side): a shrinking batch meets it only at its end,
# where a warm-up's first speculative step caught the draft up on the whole batch (~10 ms
# against 1 ms steps: H200, EAGLE3 and NEXTN at batch 4, buckets 2 and 8).
TAIL_TOKENS = 16
# With nothing waiting, the side is re-chosen on the finish estimate every this many steps (and
# after every look), not every step: the estimate walks every running request, about 80 us a
# step at batch 64 on a 2-core CPU, while a step of the default model at batch 64 lasts about
# 1.6 ms on an H100 and the host prepares the next one within it.
REDECIDE_EVERY = 8


@dataclass
class _Bucket:
    spec: Rate = field(default_factory=Rate)
    decode: Rate = field(default_factory=Rate)
    since_explore: int = 0
    explore_left: int = 0  # steps of a look still to run, on the side other than explored_from
    explore_every: int = EXPLORE_EVERY  # steps between two looks at the slower side
    explored_from: Optional[bool] = None  # the choice before the look in progress or just run
    spec_chosen: Optional[bool] = None  # the side chosen last (not counting looks)
    since_finish: int = REDECIDE_EVERY  # steps since the last choice on a finish estimate
    # Seconds a switch step took beyond the steady step after it, by direction (switches.py).
    switches: SwitchCosts = field(default_factory=SwitchCosts)
    # (speculative, plain) seconds to finish the batch at the last choice that estimated them,
    # the switch included (probe_adaptive_steps.py logs them).
    last_finish: Optional[tuple] = None
    # The running batch's accept length by shadow verifies (specpcg/speculative/shadow.py), as
    # of this bucket's step; None: not measured that way.
    shadow: Optional[float] = None
    look_close: float = LOOK_CLOSE  # the controller's (AdaptiveSpeculation.look_close)

    def side(self, spec: bool) -> Rate:
        """The speculative side's rate, or the plain one's."""
        return self.spec if spec else self.decode

    @property
    def shadowed(self) -> bool:
        """Whether shadow verifies measure the speculative side's accept length: then a
        speculative step's tokens come from them, its seconds from its own steps, and the bucket
        looks only every EXPLORE_MAX_EVERY steps (what a look still measures is a step's time,
        which a look of 3 steps in 1,024 keeps current)."""
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

    def look_every(self, spec: bool, batch_size: int) -> float:
        """Steps of the chosen (`spec`) side between two looks at the other."""
        if self.shadowed:
            return EXPLORE_MAX_EVERY
        return max(self.explore_every, self.look_wait(spec, batch_size))

    def look_wait(self, spec: bool, batch_size: int) -> float:
        """Steps of the chosen (`spec`) side between two looks so that a look costs at most
        LOOK_BUDGET of the time: its two switches, as measured, and its EXPLORE_STEPS steps of
        the other side, each losing what that step's tokens would have cost on the chosen one.
        From plain steps the switch into speculation catches up on every position the wait
        passed (switches.py): each step of the wait adds its share of the look's cost, and
        where that share is past the budget no wait is long enough."""
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
        if self.last_finish is None:
            return False
        spec_time, plain_time = self.last_finish
        mine, other = (spec_time, plain_time) if spec else (plain_time, spec_time)
        return other > mine * (1 + SWITCH_MARGIN)

    def prefer_spec(self, finish: Optional[Finish], step_s, accepts=(),
                    current: Optional[bool] = None, behind: Optional[int] = None) -> bool:
        """The faster side (per request; with `finish`, the one that ends the batch sooner,
        a step of b requests taking step_s(spec, b) seconds); the side running now (`current`,
        else the side chosen last) keeps its place unless the other is faster by SWITCH_MARGIN
        (each switch costs a slow step, switches.py; into speculation, a catch-up over `behind`
        positions). NOTE: a batch shrinking into a bucket that last chose the other side
        compared from that side: its switch went unpriced."""
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
        if self.spec_chosen is None:
            self.spec_chosen = spec >= plain
        elif self.spec_chosen and plain > spec * (1 + SWITCH_MARGIN):
            self.spec_chosen = False
        elif not self.spec_chosen and spec > plain * (1 + SWITCH_MARGIN):
            self.spec_chosen = True
        return self.spec_chosen


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


def bucket_of(batch_size: int) -> int:
    """The smallest power of two >= batch_size."""
    return 1 << max(batch_size - 1, 0).bit_length()


class AdaptiveSpeculation:
    def __init__(self):
        self._buckets: dict = {}  # bucket -> _Bucket
        self.chosen: Counter = Counter()  # (bucket, "spec" | "decode") -> steps run
        self._last_spec = None  # the side of the last recorded step: a switch is not counted
        self._interrupted = False  # a prefill ran since the last step: the next is not counted
        self._switch = None  # (bucket, side, seconds, positions) of a switch step, until the next
        self._shadow = None  # the running batch's accept length by shadow verifies, or None
        self._switches = SwitchCosts(keep=KEPT_EVERYWHERE)  # every bucket's (switches.py)
        # Plain steps since the last speculative one, and the positions the draft's catch-up
        # covers at the switch into speculation chosen last (switches.py).
        self._plain_run, self._catch_up = 0, None
        # The last step's side and bucket; whether this step's batch came from another bucket.
        self._last_choice, self._last_key, self._arrived = None, None, False
        self.accepts = deque(maxlen=KEPT_ACCEPTS)  # finished requests' (finish.priors)
        # With shadow verifies, choose on rates alone (module docstring); False prices them by
        # the finish estimate too, when nothing waits (bench_adaptive's adaptive-finish8).
        self.shadow_rates_only = True
        # LOOK_CLOSE for buckets made from now on (inf: every look gets the whole LOOK_BUDGET,
        # bench_adaptive's adaptive-whole-budget).
        self.look_close = LOOK_CLOSE

    def use_spec(self, batch_size: int, finish=None) -> bool:
        """Whether the next step of a running batch of this size should speculate. finish:
        given when no request is waiting (module docstring): a Finish, or a function that makes
        one, called only on the steps that re-choose (REDECIDE_EVERY)."""
        key = bucket_of(batch_size)
        b = self._bucket(key)
        self._arrived = self._last_key not in (None, key)
        if self._shadow is not None:
            b.shadow = self._shadow
        if b.shadowed and self.shadow_rates_only:
            finish = None  # rates alone (module docstring), at a batch's tail too
        if self._interrupted:  # not measured: it spends no warm-up step and no look
            choice = self._borrowed(key)
        elif b.spec.steps < WARMUP_STEPS or b.decode.steps < WARMUP_STEPS:
            if self._last_spec is not None and ends_within(finish, TAIL_TOKENS):
                choice = self._last_spec  # a batch's tail (TAIL_TOKENS): no warm-up
            else:
                choice = b.spec.steps < WARMUP_STEPS  # speculation's steps first
        elif b.explore_left:
            b.explore_left -= 1
            choice = not b.explored_from
        else:
            if b.explored_from is not None:  # a look just ended
                b.side(not b.explored_from).restart_if_changed(EXPLORE_STEPS - 1)
                b.last_finish = None  # set again if this choice estimates the finish
            choice = self._choose(b, finish, batch_size)
            if b.explored_from is not None:  # did the look change the choice?
                other = b.side(not choice)
                # The wait grows only once the other side's window is full, or its steps lose
                # beyond their spread (`Rate.clearly_slower`, from batch CONFIRM_MIN_BATCH): a
                # few noisy steps must not shut a side out for a thousand steps.
                confirmed = choice == b.explored_from and (
                    len(other.recent) == WINDOW
                    or (key >= CONFIRM_MIN_BATCH and (other.clearly_slower(b.tok_s(choice))
                                                      or b.finish_keeps(choice))))
                waited = max(b.explore_every, int(b.look_wait(choice, batch_size)))
                b.explore_every = (min(2 * waited, EXPLORE_MAX_EVERY) if confirmed
                                   else EXPLORE_EVERY)
                b.explored_from = None
            b.since_explore += 1
            # look_every is never below explore_every: the cheap test first spares the window
            # sums look_wait reads on most steps (the host's work between two steps).
            if (b.since_explore >= b.explore_every
                    and b.since_explore >= b.look_every(choice, batch_size)):  # look again
                b.since_explore, b.explored_from = 0, choice
                b.explore_left, choice = EXPLORE_STEPS - 1, not choice
        self.chosen[(key, "spec" if choice else "decode")] += 1
        if choice and self._plain_run:
            self._catch_up = self._plain_run * batch_size
        self._plain_run = 0 if choice else self._plain_run + 1
        self._last_choice, self._last_key = choice, key
        return choice

    def _choose(self, b: "_Bucket", finish, batch_size: int) -> bool:
        """The bucket's side for this step: re-chosen on rates alone while requests wait or
        shadow verifies measure the draft, else on the finish estimate after a look, on a
        batch's arrival and every REDECIDE_EVERY steps, and the last choice in between."""
        if finish is not None:
            due = (b.spec_chosen is None or b.explored_from is not None
                   or b.since_finish >= REDECIDE_EVERY or self._arrived)
            if not due:
                b.since_finish += 1
                return b.spec_chosen
            b.since_finish = 1
            finish = finish() if callable(finish) else finish
        # A finish estimate prices a switch from the side running now (not after a look); rates
        # keep the bucket's choice (the other lost 0.6-1.8% in 5 of 27 simulated NGRAM cells).
        current = self._last_choice if b.explored_from is None and finish is not None else None
        return b.prefer_spec(finish, lambda side, size: self._step_s(side, size, b),
                             self.accepts, current, self._plain_run * batch_size)

    def _bucket(self, key: int) -> "_Bucket":
        if key not in self._buckets:  # (setdefault would build a bucket every step)
            self._buckets[key] = _Bucket(switches=SwitchCosts(self._switches),
                                         look_close=self.look_close)
        return self._buckets[key]

    def _borrowed(self, key: int) -> bool:
        """The choice for a step that will not be measured (the one after a prefill): the side
        last chosen in the nearest bucket that has chosen one, the smaller of two equally near;
        speculation where none has. NOTE: without this, a batch size met only right after
        prefills (a batch filling up: 2, 8, 32 on the way to 64) never finished its warm-up and
        speculated at every such step (H100, NGRAM at batch 64, bench_adaptive at dae63fc)."""
        chosen = [(abs(k.bit_length() - key.bit_length()), k, b.spec_chosen)
                  for k, b in self._buckets.items() if b.spec_chosen is not None]
        return min(chosen)[2] if chosen else True

    def _step_s(self, spec: bool, batch_size: int, current: "_Bucket") -> float:
        """A step's seconds at `batch_size` on one side: its bucket's measure, else (not
        measured there yet) the current bucket's, which ran at least as many requests."""
        b = self._buckets.get(bucket_of(batch_size))
        rate = b.side(spec) if b is not None else None
        if rate is None or not rate.recent:
            rate = current.side(spec)
        return rate.step_s

    def record(self, batch_size: int, spec: bool, tokens: int, seconds: float) -> None:
        """A step of `batch_size` requests emitted `tokens` in `seconds` (host wall clock,
        the device included: each step ends in the read of its tokens), kept as tokens per
        second per request. The first step after a switch of side is not counted (module
        docstring)."""
        switched, self._last_spec = self._last_spec is not None and spec != self._last_spec, spec
        interrupted, self._interrupted = self._interrupted, False
        if seconds <= 0 or interrupted or batch_size <= 0:
            return
        key = bucket_of(batch_size)
        b = self._bucket(key)
        pending = self._switch
        self._switch = (key, spec, seconds, self._catch_up if spec else None) if switched else None
        if switched:
            return
        if pending is not None and pending[:2] == (key, spec):
            # What the switch cost beyond the steady step after it (look_wait): against that
            # step, not the side's window, which a change of speed leaves stale.
            b.switches.add(spec, pending[2] - seconds, pending[3])
        b.side(spec).add(tokens / batch_size, seconds)

    def shadow(self, accept_length: Optional[float]) -> None:
        """The running batch's accept length by its shadow verifies (their tokens per verify,
        cut at the depth its steps verify: specpcg/speculative/shadow.py), for the next step's
        choice; None keeps the last one (too few verifies since the batch changed)."""
        if accept_length is not None:
            self._shadow = accept_length

    def finished(self, req) -> None:
        """A request ended: its accept length joins the finish estimate's priors."""
        accept = finished_accept(req)
        if accept is not None:
            self.accepts.append(accept)

    def interrupt(self) -> None:
        """A prefill ran: the next decode step is not counted. A speculative one first lets the
        draft catch up on the new prompts (an eager forward over all their positions), a plain
        one with overlap scheduling starts with an empty pipeline (module docstring)."""
        self._interrupted = True

    def info(self) -> dict:
        """Per bucket: each side's measured tok/s per request and how many steps it ran."""
        out = {}
        for key in sorted(self._buckets):
            b = self._buckets[key]
            out[str(key)] = {"spec_tok_s_per_req": round(b.tok_s(True), 2),
                             "decode_tok_s_per_req": round(b.tok_s(False), 2),
                             "spec_steps": self.chosen[(key, "spec")],
                             "shadow_tokens_per_verify": (round(b.per_req(True), 3)
                                                          if b.shadowed else None),
                             "decode_steps": self.chosen[(key, "decode")]}
        return out
