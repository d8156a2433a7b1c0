"""Rates alone from plain steps (`Bucket.by_rates`): compared every RATES_EVERY steps while
plain steps lead by more than RATES_LEAD, every step in a closer race."""

import pytest

from specpcg.speculative.adaptive import WARMUP_STEPS, AdaptiveSpeculation
from specpcg.speculative.bucket import RATES_EVERY, RATES_LEAD, SPEC_HOME

STEADY = 13  # plain steps at their first speed: the wait between comparisons is running


def _switch_after_plain_slows(spec_s: float, slow_s: float) -> tuple:
    """Batch 1, rates alone: a warm-up of speculative steps of `spec_s` for one token and plain
    steps of 1 ms, STEADY more plain steps of 1 ms, then plain steps of `slow_s`. Returns
    (plain's lead after the warm-up, the first step whose rates would take speculation, the
    step the controller took it)."""
    ctrl = AdaptiveSpeculation()
    for _ in range(2 * WARMUP_STEPS):
        spec = ctrl.use_spec(1)
        ctrl.record(1, spec, 1, spec_s if spec else 1e-3)
    b = ctrl._buckets[1]
    lead, due = b.tok_s(False) / b.tok_s(True) - 1, None
    for step in range(60):
        if ctrl.use_spec(1):
            return lead, due, step
        ctrl.record(1, False, 1, 1e-3 if step < STEADY else slow_s)
        if due is None and b.tok_s(True) > b.tok_s(False) * (1 - SPEC_HOME):
            due = step + 1
    raise AssertionError("never switched")


@pytest.mark.parametrize("slow_s", [3.5e-3, 4e-3, 5e-3, 8e-3])
def test_far_behind_speculation_is_taken_at_most_rates_every_steps_late(slow_s):
    """Plain steps 2x as fast as speculation (past RATES_LEAD) slow down until speculation
    wins: the controller switches no sooner than rates say, and at most RATES_EVERY steps
    after."""
    lead, due, took = _switch_after_plain_slows(2e-3, slow_s)
    assert lead > RATES_LEAD
    assert due <= took < due + RATES_EVERY


def test_a_close_race_is_compared_every_step():
    """Plain steps within RATES_LEAD of speculation: the switch comes the step rates allow."""
    lead, due, took = _switch_after_plain_slows(1.15e-3, 1.6e-3)
    assert lead < RATES_LEAD
    assert took == due


def test_far_ahead_plain_steps_compare_the_rates_once_every_rates_every_steps(monkeypatch):
    """The point of the wait: on a batch of one's steady plain steps, far ahead, the two rates
    are read and compared once in RATES_EVERY steps, not every step (host work)."""
    from specpcg.speculative.bucket import Bucket

    picks = []
    real = Bucket._pick
    monkeypatch.setattr(Bucket, "_pick", lambda self, *a: picks.append(a) or real(self, *a))
    ctrl = AdaptiveSpeculation()
    for _ in range(2 * WARMUP_STEPS + 24):
        spec = ctrl.use_spec(1)
        ctrl.record(1, spec, 1, 2e-3 if spec else 1e-3)
    assert not spec
    assert len(picks) == 1 + -(-24 // RATES_EVERY)  # the first choice, then one in 8
