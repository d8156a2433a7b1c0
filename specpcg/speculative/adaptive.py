"""Adaptive speculation: per running-batch size, speculate only where it pays.

A speculative step verifies N tokens per request to emit its accept length; at batch 1 that is
nearly free, at batch 64 a verify is a 64 x N-row forward that can cost more than the tokens it
yields. Which side of that line a batch size falls on depends on the model, the GPU, the draft and
the prompts, so the engine measures it: for each batch-size bucket (powers of two) it keeps the
emitted tokens per second of speculative steps and of plain decode steps, and runs the faster. Each
side is tried WARMUP_STEPS times before the first choice, and the slower side again for
EXPLORE_STEPS steps after EXPLORE_EVERY steps, so a choice follows the prompts as they change. Each
look that confirms the choice doubles the wait before the next (up to EXPLORE_MAX_EVERY); a look
that overturns it resets the wait: a steady gap costs ever fewer steps of the slower side, and a
look waits long enough that it costs at most LOOK_BUDGET of the time (its switches as measured, and
its steps on the slower side: NGRAM at batch 1 on the H100 spent about a tenth of its steps in
looks at 0.6x the plain rate, and ran 0.94x no-spec). The side in use keeps its place unless the
other is SWITCH_MARGIN faster; from plain steps, where a draft catches up to switch, speculation
need only come within SPEC_HOME of them (bucket.py).

Only steady-state steps count: the first step after a switch of side, and the first after a
prefill, are not recorded; nor is an overlapped plain call that only launched its step. A step
after a prefill, never measured, takes the nearest bucket's choice, its draft's catch-up priced
where nothing waits (`_after_prefill`). A switch costs what switches.py says, kept per direction.
The step a switch reads first (the other side's, still in flight) is a steady speculative step out
of speculation, and into it part of the switch's cost: the draft's catch-up ran before that read
(`flushed`). Counting those switches made speculation at batch 1 look 0.57x as fast as it runs
(H100, EAGLE3: 563 tok/s measured against 995 pinned); counting the step after a prefill (its draft
catching up on whole prompts) made EAGLE3 at batch 16 run plain steps at 0.83x no-spec where pinned
speculation ran 1.31x (H100, 4a5cc11).

Rates are per request (tokens per second per running request): a bucket spans batch sizes a factor
of two apart, and as requests finish a batch shrinks through it, so the side measured first
measured at the larger batch. Counting tokens of the whole batch made NGRAM and EAGLE3 speculate at
batch 64 (the warm-up speculates first) where plain steps ran 1.3x faster (H100: an NGRAM engine
held to plain steps matched a no-spec engine, 14.5-16.2k against 14.7k tok/s, while the adaptive
one ran 0.6-0.7x).

With requests waiting, the engine maximises throughput: the faster side per request. With none
waiting, the running batch is all there is, and it ends with its slowest request. A speculative
step then helps only as much as it advances that request, since the tokens it gives the others
early do not shorten the batch: a batch thinned by uneven acceptance runs its last steps nearly as
slowly as a full one. So the engine compares the time to finish the batch (`Finish`): plain steps
take max(remaining) steps; speculative ones max(remaining / accept length) of each request's own
accept length so far. NGRAM at batch 64 (H100, 20d835f) measured 11% faster per request
speculating, yet pinned speculation ran 0.81x no-spec. Each side's time to finish counts the batch
shrinking as its requests finish (finish.py).

A side's rate is the ratio of its tokens to its seconds over its last WINDOW steps. An average of
per-step rates, as before, let a noisy side lose for good: NGRAM accepts nothing on one verify and
seven drafts on the next, and the side not chosen keeps the value it had when it lost, which is
more often a low one. Simulated at batch 1 with speculation 1.5x faster on average, that controller
ran 1.10x (1.02x at worst); with windows 1.39x (1.11x at worst). For the same reason the wait
between looks grows only once the other side's window is full, or, from batch CONFIRM_MIN_BATCH on,
once its steps lose by more than their own spread.

A batch of one measures speculation per stretch of its request's output (bucket.place_of: the first
16 tokens, then stretches doubling in length), its accept length shrunk toward every stretch's
(rates.PlacedRate), and chooses on those rates alone: with one request the finish estimate is the
rates' comparison, over an accept length blind to where in the answer the request is. A draft's
acceptance changes along an answer: the default command's STANDALONE draft took 1.5 tokens a verify
over a chat answer's first 4 verifies and 2.40 over all 53 (H200, d14091e), where a verify paid
above 1.9; a warm-up and the looks measured speculation at the answers' starts, and the adaptive
engine decoded plain at 0.96-0.98x no-spec while pinned speculation ran 1.18-1.24x. Simulated with
acceptance rising along each answer, the position-blind controller ran 0.84-0.99 of the faster
pinned side, this one 0.95-1.02 (`sim_adaptive.py --growth`; rates.PLACE_PRIOR_STEPS has the
figures). Side by side on an H200 (4649a57, bench_adaptive's adaptive-unplaced), that draft at
batch 1 ran 1.22-1.25x no-spec in 5 of 5 rounds where the blind controller began a run at 0.96x.

NGRAM needs no looks to know its accept length: shadow verifies price it (shadow.py).

Both sides emit the target's own tokens, so the choice changes speed only; a plain step still
hands the target's hidden states to the draft, which catches up on them at its next round.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

from specpcg.speculative.bucket import (EXPLORE_EVERY, EXPLORE_MAX_EVERY, EXPLORE_STEPS,
                                        LOOK_CLOSE, LOOK_PRICED_AHEAD, LOOK_PRICED_EVERY,
                                        REDECIDE_EVERY, REDECIDE_MAX_EVERY, SETTLED_LEAD,
                                        SPEC_HOME, Bucket, bucket_of, measured_step_s)
from specpcg.speculative.finish import KEPT_ACCEPTS, MIN_ACCEPTS, ends_within, finished_accept
from specpcg.speculative.rates import WINDOW
from specpcg.speculative.switches import KEPT_EVERYWHERE, SwitchCosts

WARMUP_STEPS = 3  # steps of each side per bucket before choosing
# From this batch on a look may confirm early (specpcg/speculative/rates.py, `CONFIRM_Z`).
CONFIRM_MIN_BATCH = 4
# With nothing waiting and at most this many tokens left to any request, a bucket not measured
# yet is not warmed up (its batch stays on its side): a shrinking batch meets it only at its end,
# where a warm-up's first speculative step caught the draft up on the whole batch (~10 ms
# against 1 ms steps: H200, EAGLE3 and NEXTN at batch 4, buckets 2 and 8).
TAIL_TOKENS = 16


class AdaptiveSpeculation:
    def __init__(self):
        self._buckets: dict = {}  # bucket -> Bucket
        self.chosen: Counter = Counter()  # (bucket, "spec" | "decode") -> steps run
        # (bucket, why) -> switches of side, by what chose the step that switched (switches.py)
        self.switched: Counter = Counter()
        self._last_spec = None  # the side of the last recorded step: a switch is not counted
        self._interrupted = False  # a prefill ran since the last step: the next is not counted
        self._switch = None  # (bucket, side, seconds, positions) of a switch step, until the next
        # Seconds the step flushed at a switch into speculation took beyond a plain step (the
        # draft's catch-up ran before its read): the switch step's too (`flushed`).
        self._switch_extra = 0.0
        # False: flushed steps are not counted, as before `flushed` (adaptive-unflushed).
        self.count_flushed = True
        self._shadow = None  # the running batch's accept length by shadow verifies, or None
        self._switches = SwitchCosts(keep=KEPT_EVERYWHERE)  # every bucket's (switches.py)
        # Plain steps since the last speculative one, and the positions the draft's catch-up
        # covers at the switch into speculation chosen last (switches.py).
        self._plain_run, self._catch_up = 0, None
        self._behind = None  # this step's use_spec `behind` (_lag)
        # (batch size, plain window) of the last plain step recorded in full: the next plain
        # step of that size, no prefill or flush between, only joins the window (`record`).
        self._steady = None
        # The last step's side and bucket; whether this step's batch came from another bucket.
        self._last_choice, self._last_key, self._arrived = None, None, False
        self.accepts = deque(maxlen=KEPT_ACCEPTS)  # finished requests' (finish.priors)
        # With shadow verifies, price them by the finish estimate when nothing waits (shadow.py
        # says why); True chooses on rates alone (bench_adaptive's adaptive-shadow-rates).
        self.shadow_rates_only = False
        # LOOK_CLOSE for buckets made from now on (inf: every look gets the whole LOOK_BUDGET,
        # bench_adaptive's adaptive-whole-budget).
        self.look_close = LOOK_CLOSE
        self.relook_below = 0  # Bucket's, for buckets made from now on (adaptive-shadow-relook)
        # How much faster than plain steps speculation must be to switch into it, for buckets
        # made from now on (SPEC_HOME; SWITCH_MARGIN: as out of it, bench_adaptive's
        # adaptive-symmetric).
        self.into_spec = -SPEC_HOME
        # finish.MIN_ACCEPTS: finished requests before their accept lengths are priors (16:
        # adaptive-min16).
        self.min_accepts = MIN_ACCEPTS
        self.place_batch_of_one = True  # False: blind to a batch of one's place (adaptive-unplaced)

    def use_spec(self, batch_size: int, finish=None, behind=None,
                 position: Optional[int] = None) -> bool:
        """Whether the next step of a running batch of this size should speculate. finish:
        given when no request is waiting (module docstring): a Finish, or a function that makes
        one, called only on the steps that re-choose (REDECIDE_EVERY). behind: the positions a
        switch into speculation would catch the draft up on (`DraftWorker.catch_up_positions`),
        or a function that counts them, called only on the steps that price a switch; None:
        the plain steps since the last speculative one times the batch size. position: a batch
        of one's output tokens so far, where no shadow verifies measure the draft (module
        docstring)."""
        key = bucket_of(batch_size)
        b = self._bucket(key)
        self._behind = behind
        self._arrived = self._last_key not in (None, key)
        ends = finish  # a batch of one's finish too, for the step after a prefill
        if self._shadow is not None:
            b.shadow = self._shadow
        elif position is not None and batch_size == 1 and self.place_batch_of_one:
            b.place(position)
            finish = None  # one request: the rates, at its place in the answer
        if b.shadowed and self.shadow_rates_only:
            finish = None  # rates alone (module docstring), at a batch's tail too
        if self._interrupted:  # not measured: it spends no warm-up step and no look
            choice, why = self._after_prefill(key, b, ends, batch_size), "borrowed"
        elif b.spec.steps < WARMUP_STEPS or b.decode.steps < WARMUP_STEPS:
            if self._last_spec is not None and ends_within(finish, TAIL_TOKENS):
                choice, why = self._last_spec, "tail"  # a batch's tail: no warm-up
            else:
                choice, why = b.spec.steps < WARMUP_STEPS, "warm-up"  # speculation's first
        elif b.explore_left:
            b.explore_left -= 1
            choice, why = not b.explored_from, "look"
        else:
            looked = b.explored_from  # the side a look just ended back to, or None
            if looked is not None:
                b.side(not looked).restart_if_changed(EXPLORE_STEPS - 1)
                b.last_finish = None  # set again if this choice estimates the finish
            choice = self._choose(b, finish, batch_size)
            why = "look" if choice == looked else "rates" if finish is None else "finish"
            if looked is not None:
                self._end_look(b, choice, key, batch_size)
            b.since_explore += 1
            if self._look_due(b, choice, batch_size):  # look again
                b.since_explore, b.explored_from, b.look_priced = 0, choice, (None, 0)
                b.explore_left, choice, why = EXPLORE_STEPS - 1, not choice, "look"
        if self._last_choice is not None and choice != self._last_choice:
            self.switched[(key, why)] += 1
        self.chosen[(key, "spec" if choice else "decode")] += 1
        if choice and self._plain_run:
            self._catch_up = self._lag(batch_size)
        self._plain_run = 0 if choice else self._plain_run + 1
        self._last_choice, self._last_key = choice, key
        return choice

    def skip(self, batch_size: int) -> None:
        """A plain step the engine runs without asking (a batch above the user's cap,
        speculative_disable_by_batch_size): counted as plain for the next switch's catch-up,
        choosing nothing and looking nowhere."""
        key = bucket_of(batch_size)
        self._bucket(key)  # reported by info()
        self.chosen[(key, "decode")] += 1
        if self._last_choice:
            self.switched[(key, "cap")] += 1
        self._plain_run += 1
        self._last_choice, self._last_key = False, key

    def _end_look(self, b: "Bucket", choice: bool, key: int, batch_size: int) -> None:
        """A look just ended: whether it confirmed the choice sets the wait before the next.
        The wait grows only once the other side's window is full, or its steps lose beyond
        their spread (`Rate.clearly_slower`, from batch CONFIRM_MIN_BATCH), or a batch of one's
        place loses by far (`PlacedRate.far_behind`): a few noisy steps must not shut a side
        out for a thousand steps."""
        other = b.side(not choice)
        confirmed = choice == b.explored_from and (
            len(other.recent) == WINDOW or (not choice and other.far_behind(b.tok_s(False)))
            or (key >= CONFIRM_MIN_BATCH and (other.clearly_slower(b.tok_s(choice))
                                              or b.finish_keeps(choice))))
        waited = max(b.explore_every, int(b.look_wait(choice, batch_size)))
        b.explore_every = min(2 * waited, EXPLORE_MAX_EVERY) if confirmed else EXPLORE_EVERY
        b.explored_from = None

    def _choose(self, b: "Bucket", finish, batch_size: int) -> bool:
        """The bucket's side for this step: re-chosen on rates alone while requests wait (or
        shadow verifies on rates alone: `Bucket.by_rates`), else on the finish estimate after a
        look, on a batch's arrival and every REDECIDE_EVERY steps (more while the choice stays
        settled, SETTLED_LEAD, but where shadow verifies price it), and the last choice in
        between."""
        if finish is None:
            return b.by_rates(self._arrived)
        fresh = b.explored_from is not None or self._arrived
        every = b.redecide_every or REDECIDE_EVERY
        if not (b.spec_chosen is None or fresh or b.since_finish >= every):
            b.since_finish += 1
            return b.spec_chosen
        b.since_finish, before = 1, b.spec_chosen
        finish = finish() if callable(finish) else finish
        # A finish estimate prices a switch from the side running now (not after a look); rates
        # keep the bucket's choice (the other lost 0.6-1.8% in 5 of 27 simulated NGRAM cells).
        current = self._last_choice if b.explored_from is None else None
        choice = b.prefer_spec(finish, *self._pricing(b), current, self._lag(batch_size))
        settled = (not fresh and not b.shadowed and choice == before
                   and b.lead(choice) > SETTLED_LEAD)
        b.redecide_every = min(2 * every, REDECIDE_MAX_EVERY) if settled else 0
        return choice

    def _look_due(self, b: "Bucket", choice: bool, batch_size: int) -> bool:
        """Whether the bucket looks at the other side now. look_every is never below
        explore_every: the cheap test first spares the window sums look_wait reads on most
        steps (the host's work between two steps). From plain steps, with the draft's lag
        known, the look must also fit what its catch-up would cost now: the lag counts the
        prompts, which the plain steps alone leave out (README, "The draft's whole lag": on
        an H200 it made no difference; simulated, 1.000 of the faster pinned side, from 0.98).
        A batch of one looks at an unmeasured stretch before it ends (`Bucket.place_unmeasured`)."""
        side, until = b.look_priced
        if b.since_explore < b.explore_every or (side == choice and b.since_explore < until):
            return False
        wait = b.look_every(choice, batch_size)
        if wait <= b.since_explore and not (choice or b.shadowed or self._behind is None):
            wait = b.look_wait(False, batch_size, self._lag(batch_size))
        if b.since_explore >= wait or not choice and b.place_unmeasured(wait - b.since_explore):
            return True
        # priced again once due, or LOOK_PRICED_AHEAD of the way there (a batch of one, whose
        # looks follow its place in the answer: LOOK_PRICED_EVERY steps on)
        ahead = LOOK_PRICED_EVERY
        if batch_size > 1:
            ahead = max(ahead, int(LOOK_PRICED_AHEAD * (wait - b.since_explore)))
        b.look_priced = (choice, min(wait, b.since_explore + ahead))
        return False

    def _lag(self, batch_size: int) -> int:
        """The positions a switch into speculation catches the draft up on (use_spec's
        `behind`, counted once a step)."""
        if callable(self._behind):
            self._behind = self._behind()  # None where the draft has no catch-up (NGRAM)
        return self._plain_run * batch_size if self._behind is None else self._behind

    def _bucket(self, key: int) -> "Bucket":
        if key not in self._buckets:  # (setdefault would build a bucket every step)
            self._buckets[key] = Bucket(switches=SwitchCosts(self._switches),
                                         look_close=self.look_close, into_spec=self.into_spec,
                                         relook_below=self.relook_below)
        return self._buckets[key]

    def _after_prefill(self, key: int, b: "Bucket", finish, batch_size: int) -> bool:
        """The nearest bucket's side (`_borrowed`); with nothing waiting, in a measured bucket
        whose draft catches up, speculation only if it ends the batch sooner paying the catch-up
        on the new prompts. NOTE: unpriced, batches that ended speculating began the next so."""
        borrowed = self._borrowed(key)
        if (not borrowed or finish is None or b.shadowed
                or min(b.spec.steps, b.decode.steps) < WARMUP_STEPS):
            return borrowed
        lag = self._lag(batch_size)
        if self._behind is None:  # no catch-up (NGRAM)
            return borrowed
        return b.from_plain(finish() if callable(finish) else finish, *self._pricing(b), lag)

    def _pricing(self, b: "Bucket") -> tuple:
        """prefer_spec's step seconds by side and batch size, and finished accept lengths."""
        accepts = self.accepts if len(self.accepts) >= self.min_accepts else ()
        return lambda side, size: measured_step_s(self._buckets, side, size, b), accepts

    def _borrowed(self, key: int) -> bool:
        """The choice for a step that will not be measured (the one after a prefill): the side
        last chosen in the nearest bucket that has chosen one, the smaller of two equally near;
        speculation where none has. NOTE: without this, a batch size met only right after
        prefills (a batch filling up: 2, 8, 32 on the way to 64) never finished its warm-up and
        speculated at every such step (H100, NGRAM at batch 64, bench_adaptive at dae63fc)."""
        chosen = [(abs(k.bit_length() - key.bit_length()), k, b.spec_chosen)
                  for k, b in self._buckets.items() if b.spec_chosen is not None]
        return min(chosen)[2] if chosen else True

    def record(self, batch_size: int, spec: bool, tokens: int, seconds: float) -> None:
        """A step of `batch_size` requests emitted `tokens` in `seconds` (host wall clock,
        the device included: each step ends in the read of its tokens), kept as tokens per
        second per request. The first step after a switch of side is not counted (module
        docstring). A steady plain step (the batch size of the last plain step recorded, no
        prefill, switch or flush since) leaves nothing else to settle, so it only joins its
        window: every plain step takes this path on the host (docs/PERFORMANCE.md, "An
        adaptive engine's plain step: its host work")."""
        steady = self._steady
        if steady is not None and not spec and steady[0] == batch_size:
            if seconds > 0:
                steady[1].add(tokens / batch_size, seconds)
            return
        self._steady = None
        switched, self._last_spec = self._last_spec is not None and spec != self._last_spec, spec
        interrupted, self._interrupted = self._interrupted, False
        extra, self._switch_extra = self._switch_extra, 0.0
        if seconds <= 0 or interrupted or batch_size <= 0:
            return
        key = bucket_of(batch_size)
        b = self._bucket(key)
        pending = self._switch
        self._switch = ((key, spec, seconds + extra, self._catch_up if spec else None)
                        if switched else None)
        if switched:
            return
        if pending is not None and pending[:2] == (key, spec):
            # What the switch cost beyond the steady step after it (look_wait): against that
            # step, not the side's window, which a change of speed leaves stale.
            b.switches.add(spec, pending[2] - seconds, pending[3])
        b.side(spec).add(tokens / batch_size, seconds)
        if not spec:
            self._steady = (batch_size, b.decode)

    def flushed(self, batch_size: int, spec: bool, tokens: int, seconds: float) -> None:
        """The step in flight of the side a switch leaves (overlap scheduling), read at the
        switch, `seconds` from the end of the step before it. Out of speculation it is a steady
        speculative step, recorded: a look's last step (else its only steady one after the
        switch step; at batch 1 a look then measured one step's accept length). Into
        speculation the draft caught up on the host before that read (SpecOverlap.catch_up):
        what the step took beyond a plain step is the switch's, added to the switch step's
        seconds. NOTE: uncounted, a STANDALONE draft's catch-ups of 2-18 ms priced every switch
        into speculation at about 1 ms (H200, 283c27a, probe_adaptive_steps.py)."""
        self._steady = None  # the next plain step may be priced as a switch's
        if not self.count_flushed or seconds <= 0 or batch_size <= 0:
            return
        if spec:
            self.record(batch_size, True, tokens, seconds)
            return
        b = self._buckets.get(bucket_of(batch_size))
        if b is not None and b.decode.step_s > 0:
            self._switch_extra = max(seconds - b.decode.step_s, 0.0)

    def switches(self) -> Counter:
        """Switches of side so far by what chose them (switches.SWITCH_WHY), every bucket."""
        return sum((Counter({why: n}) for (_, why), n in self.switched.items()), Counter())

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
        self._interrupted, self._steady = True, None

    def info(self) -> dict:
        """Per bucket: each side's measured tok/s per request, how many steps it ran, and its
        window's least, median and most step time (ms) (`Bucket.report`)."""
        return {str(key): self._buckets[key].report(
                    self.chosen[(key, "spec")], self.chosen[(key, "decode")],
                    {why: n for (k, why), n in sorted(self.switched.items()) if k == key})
                for key in sorted(self._buckets)}
