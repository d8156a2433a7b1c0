"""Adaptive speculation for a batch of one, by where its request is in its answer
(`Bucket.place`, `PlacedRate`): a draft's acceptance changes along an answer, and a batch of one
measures speculation per stretch of its output."""

import random

import pytest

from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.bucket import PLACE_TOKENS, Bucket, bucket_of, place_of
from specpcg.speculative.finish import Finish
from specpcg.speculative import rates
from specpcg.speculative.rates import (FAR_BEHIND, FAR_MIN_STEPS, PLACE_PRIOR_STEPS,
                                       PlacedRate, Rate)
from tests.eagle_world import _engine, world  # noqa: F401
from tests.test_adaptive import _noisy_run

SPEC_S, PLAIN_S = 1.0e-3, 0.6e-3  # a verify's seconds and a plain step's


def _answer(ctrl, placed: bool, late_from: int, tokens: int = 128) -> tuple:
    """One request alone, asked as the scheduler asks (nothing waits: a finish estimate): each
    verify accepts nothing before output position `late_from` and 3 drafts from there. Returns
    (seconds, the side of each step from late_from on)."""
    pos = verifies = spec_tokens = 0
    seconds, late = 0.0, []
    while pos < tokens:
        finish = Finish(remaining=(tokens - pos,), spec_tokens=(spec_tokens,),
                        verifies=(verifies,))
        spec = ctrl.use_spec(1, finish, None, pos if placed else None)
        got = min(4 if spec and pos >= late_from else 1, tokens - pos)
        if spec:
            verifies, spec_tokens = verifies + 1, spec_tokens + got
        if pos >= late_from:
            late.append(spec)
        step = SPEC_S if spec else PLAIN_S
        ctrl.record(1, spec, got, step)
        pos, seconds = pos + got, seconds + step
    ctrl.interrupt()  # the next request's prefill
    return seconds, late


def _answers(placed: bool, late_from: int, n: int = 8, ctrl=None) -> list:
    ctrl = ctrl or AdaptiveSpeculation()
    return [_answer(ctrl, placed, late_from) for _ in range(n)]


def test_a_batch_of_one_speculates_where_its_answer_accepts():
    """Verifies accept nothing in an answer's first half and pay 2.4x plain steps in its
    second. Blind to the place, the controller measures speculation over both halves, mostly
    the first, and decodes plain through nearly all of the later answers' second halves (a
    look that lands there speculates a few steps); placed, it speculates through most of every
    later answer's second half and runs its answers over 15% sooner."""
    placed, blind = _answers(True, 64), _answers(False, 64)
    spec_late = [sum(late) / len(late) for _, late in placed[2:]]
    assert min(spec_late) >= 0.8 and spec_late[-4:] == [1.0] * 4, spec_late
    blind_late = [late for _, late in blind[2:]]
    assert sum(map(sum, blind_late)) <= 0.1 * sum(map(len, blind_late)), list(map(sum, blind_late))
    assert sum(s for s, _ in placed[2:]) < 0.85 * sum(s for s, _ in blind[2:])


@pytest.mark.parametrize("late_from", [0, 10 ** 9], ids=["always pays", "never pays"])
def test_placing_a_batch_of_one_costs_nothing_where_acceptance_is_steady(late_from):
    """A draft that pays anywhere, or nowhere: the placed controller runs within 0.5% of the
    blind one (a place no step measured takes every place's rate, so it costs no warm-up) and
    looks at most once more per place (a look at a place it knows little of is priced free)."""
    ctrls = AdaptiveSpeculation(), AdaptiveSpeculation()
    placed = sum(s for s, _ in _answers(True, late_from, ctrl=ctrls[0]))
    blind = sum(s for s, _ in _answers(False, late_from, ctrl=ctrls[1]))
    assert placed <= 1.005 * blind, (placed, blind)
    places = len(ctrls[0]._buckets[1].places)
    assert ctrls[0].switches()["look"] <= ctrls[1].switches()["look"] + places


def test_places_are_stretches_of_output_doubling_in_length():
    assert [place_of(p) for p in (0, PLACE_TOKENS - 1)] == [0, 0]
    assert [place_of(p) for p in (PLACE_TOKENS, 2 * PLACE_TOKENS - 1)] == [1, 1]
    assert [place_of(p) for p in (2 * PLACE_TOKENS, 4 * PLACE_TOKENS - 1)] == [2, 2]
    assert place_of(4 * PLACE_TOKENS) == 3


def test_a_places_accept_length_is_shrunk_toward_every_places():
    """A place without steps takes every place's accept length; with n steps of its own, their
    mean weighs n against PLACE_PRIOR_STEPS; the step time is every place's."""
    every = Rate()
    early, late = PlacedRate(every), PlacedRate(every)
    for _ in range(PLACE_PRIOR_STEPS):
        early.add(1.0, SPEC_S)
    assert late.per_req == pytest.approx(1.0) and late.step_s == pytest.approx(SPEC_S)
    for _ in range(PLACE_PRIOR_STEPS):
        late.add(4.0, 2 * SPEC_S)
    # every place's mean is 2.5; late's own 4.0, with as many steps as the prior's weight
    assert every.per_req == pytest.approx(2.5)
    assert late.per_req == pytest.approx((4.0 + 2.5) / 2)
    assert early.per_req == pytest.approx((1.0 + 2.5) / 2)
    assert late.step_s == early.step_s == every.step_s
    assert late.tok_s == pytest.approx(late.per_req / every.step_s)
    assert late.steps == early.steps == 2 * PLACE_PRIOR_STEPS  # every place's, for the warm-up


def _looks_per_answer(answers: int) -> list:
    ctrl, looks = AdaptiveSpeculation(), []
    for _ in range(answers):
        before = ctrl.switches()["look"]
        _answers(True, 10 ** 9, n=1, ctrl=ctrl)
        looks.append(ctrl.switches()["look"] - before)
    return looks


def test_a_batch_of_one_looks_ever_more_rarely_at_a_draft_that_never_pays(monkeypatch):
    """Verifies that accept nothing, each 1.67x a plain step: once every place's window holds
    FAR_MIN_STEPS steps, a look at a place whose own window is not full yet confirms plain
    steps (`PlacedRate.far_behind`), and the wait before the next doubles. Without that (a
    look confirming only on the place's full window) every answer of 128 tokens looked at
    one place or two."""
    looks = _looks_per_answer(24)
    assert sum(looks[4:]) <= 4 and looks[-8:].count(0) >= 6, looks
    monkeypatch.setattr(rates, "FAR_BEHIND", float("inf"))
    unfar = _looks_per_answer(24)
    assert sum(unfar[4:]) >= 4 * sum(looks[4:]) + 20, (unfar, looks)


def test_a_place_is_far_behind_once_every_place_has_steps_and_it_loses_by_far():
    every = Rate()
    place = PlacedRate(every)
    plain_rate = 1 / PLAIN_S  # plain steps' tokens per second
    for _ in range(FAR_MIN_STEPS - 1):
        every.add(1.0, SPEC_S)
    assert not place.far_behind(plain_rate)  # too few steps measured anywhere
    every.add(1.0, SPEC_S)
    assert place.tok_s * FAR_BEHIND < plain_rate and place.far_behind(plain_rate)
    place.add(2.0, SPEC_S)  # its own step pulls it within FAR_BEHIND of plain
    assert place.tok_s * FAR_BEHIND >= plain_rate and not place.far_behind(plain_rate)


def test_a_faster_but_noisy_side_told_its_place_is_not_shut_out():
    """tests/test_adaptive.py's noisy side (speculation 1.5x faster) along answers of 256
    tokens, each stretch measured on its own: a look at a stretch confirms plain steps early
    only where that stretch is far behind (`far_behind`), which a bad streak shrunk toward
    every stretch's rate is not. (12 seeds: 1.47x on average, 1.43x at worst; 1.48x / 1.44x
    before far_behind.)"""
    speeds = [_noisy_run(seed, answer=256) for seed in range(12)]
    assert sum(speeds) / len(speeds) >= 1.4, speeds
    assert min(speeds) >= 1.3, speeds


# A trained EAGLE3 head on the default model at batch 1 (H100, 23a4281,
# probe_adaptive_steps.py): each draft token's accept chance by stretch of the answer (accept
# lengths 1.09 / 2.71 / 1.88 / 2.42 / 2.63 a verify), a verify's and a plain step's seconds,
# and a switch into speculation's catch-up: 10.3 ms the engine's first, 1.4 ms later.
HEAD_CHANCE, HEAD_SPEC_S, HEAD_PLAIN_S = (0.09, 0.64, 0.48, 0.59, 0.62), 0.734e-3, 0.49e-3


def _head_answers(ctrl, seed: int, answers: int = 4, tokens: int = 256) -> float:
    """Seconds of `answers` answers of one request alone, each step chosen by ctrl (None:
    pinned speculation), each draft token accepted with its stretch's HEAD_CHANCE."""
    rng, looks, seconds = random.Random(seed), 0, 0.0
    for _ in range(answers):
        pos, last = 0, None
        while pos < tokens:
            finish = Finish(remaining=(tokens - pos,), spec_tokens=(0,), verifies=(0,))
            spec = True if ctrl is None else ctrl.use_spec(1, finish, None, pos)
            got, chance = 1, HEAD_CHANCE[min(place_of(pos), len(HEAD_CHANCE) - 1)]
            while spec and got < 8 and rng.random() < chance:
                got += 1
            step = HEAD_SPEC_S if spec else HEAD_PLAIN_S
            if spec and last is False:  # the draft catches up on the plain steps' positions
                step, looks = step + (10.3e-3 if looks == 0 else 1.4e-3), looks + 1
            if ctrl is not None:
                ctrl.record(1, spec, min(got, tokens - pos), step)
            pos, seconds, last = pos + got, seconds + step, spec
        if ctrl is not None:
            ctrl.interrupt()
    return seconds


def test_a_batch_of_one_looks_at_a_stretch_speculation_has_not_measured(monkeypatch):
    """The head above: its warm-up at the answer's start measures speculation slower than
    plain steps, and the first look's cold catch-up priced every later look at hundreds of
    steps, so no stretch that pays was ever measured: the engine decoded plain at 0.99x
    no-spec where pinned speculation ran 1.40x. Looked at unpriced on reaching a stretch of
    its own not measured (and not far behind everywhere), it takes 1.13x pinned
    speculation's time over these answers; with every look priced, 1.42x."""
    pinned = sum(_head_answers(None, seed) for seed in range(6))
    looked = sum(_head_answers(AdaptiveSpeculation(), seed) for seed in range(6))
    monkeypatch.setattr(Bucket, "place_unmeasured", lambda self, wait: False)
    priced = sum(_head_answers(AdaptiveSpeculation(), seed) for seed in range(6))
    assert looked <= 1.2 * pinned and priced >= 1.25 * pinned, (looked, priced, pinned)


def test_only_a_batch_of_one_is_placed_and_the_unplaced_hold_turns_it_off():
    ctrl = AdaptiveSpeculation()
    ctrl.use_spec(1, None, None, 40)
    ctrl.use_spec(2, None, None, None)
    assert set(ctrl._buckets[1].places) == {place_of(40)}
    assert not ctrl._buckets[bucket_of(2)].places
    blind = AdaptiveSpeculation()
    blind.place_batch_of_one = False
    blind.use_spec(1, None, None, 40)
    assert not blind._buckets[1].places


class _Told(AdaptiveSpeculation):
    """The engine's controller, keeping each step's batch size, the position it is told and
    the running request's output length."""

    def __init__(self, scheduler):
        super().__init__()
        self.scheduler, self.told = scheduler, []

    def use_spec(self, batch_size, finish=None, behind=None, position=None):
        first = self.scheduler.running[0]
        self.told.append((batch_size, position, len(first.output_ids)))
        return super().use_spec(batch_size, finish, behind, position)


@pytest.mark.parametrize("algo", ["STANDALONE", "NGRAM"])
def test_the_scheduler_tells_a_batch_of_one_where_its_request_is(world, algo):  # noqa: F811
    """A batch of one is told its request's output length; a larger batch nothing; NGRAM's
    batches nothing (shadow verifies measure its draft along the answer)."""
    draft = world.exact if algo == "STANDALONE" else None
    engine = _engine(world.noisy, algo, draft, disable_adaptive_speculation=False)
    ctrl = engine.scheduler.adaptive = _Told(engine.scheduler)
    engine.generate(input_ids=world.prompts[0], sampling_params=world.params[0])
    engine.generate(input_ids=world.prompts[:2], sampling_params=world.params[:2])
    ones = [t for t in ctrl.told if t[0] == 1]
    assert ones and any(t[0] > 1 for t in ctrl.told)
    assert all(position is None for bs, position, _ in ctrl.told if bs > 1)
    if algo == "NGRAM":
        assert all(position is None for _, position, _ in ones)
    else:
        assert all(position == out for _, position, out in ones)
