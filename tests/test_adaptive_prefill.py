"""Adaptive speculation at the step after a prefill: the draft's catch-up on the new prompts is
priced where nothing waits (AdaptiveSpeculation._after_prefill)."""

import pytest

from specpcg.speculative.adaptive import WARMUP_STEPS, AdaptiveSpeculation
from specpcg.speculative.finish import Finish

BS, ACCEPT = 4, 8
SPEC_S, PLAIN_S = 0.005, 0.00066  # per request 1,600 against 1,515 tok/s: speculation leads


def _speculating() -> AdaptiveSpeculation:
    """Bucket 4 warmed up on both sides and on speculation, its catch-ups measured at 2 ms
    and 20 us a position."""
    ctrl = AdaptiveSpeculation()
    for _ in range(2 * WARMUP_STEPS + 2):
        use = ctrl.use_spec(BS, behind=0)
        ctrl.record(BS, use, BS * (ACCEPT if use else 1), SPEC_S if use else PLAIN_S)
    switches = ctrl._bucket(BS).switches
    switches.add(True, 0.002 + 20e-6 * 40, 40)
    switches.add(True, 0.002 + 20e-6 * 400, 400)
    assert ctrl.use_spec(BS, behind=0) is True
    ctrl.record(BS, True, BS * ACCEPT, SPEC_S)
    return ctrl


def _fresh(left: int = 120) -> Finish:
    """A new batch: nothing emitted, `left` tokens to go each; the finish estimate takes the
    bucket's accept length as its prior."""
    return Finish(remaining=(left,) * BS, spec_tokens=(0,) * BS, verifies=(0,) * BS)


def test_a_new_batch_starts_plain_where_the_prompts_catch_up_costs_more_than_speculation_wins():
    """75 ms of speculative steps against 79 ms of plain ones, but catching the draft up on
    4 new 128-token prompts costs 12 ms: plain steps, and they stay chosen after it."""
    ctrl = _speculating()
    ctrl.interrupt()
    assert ctrl.use_spec(BS, lambda: _fresh(), behind=BS * 128) is False
    ctrl.record(BS, False, BS, PLAIN_S)
    assert ctrl.use_spec(BS, _fresh(119), behind=BS * 129) is False
    assert ctrl.switches()["borrowed"] == 1


@pytest.mark.parametrize("case", ["small lag", "no catch-up", "requests waiting"])
def test_a_new_batch_keeps_speculating_where_the_catch_up_is_cheap_or_unpriced(case):
    """A few positions to catch up on cost less than speculation wins; a draft without a
    catch-up (NGRAM: behind is None) and a batch with requests waiting (every new request's
    catch-up is paid whenever it speculates) borrow the side as before."""
    ctrl = _speculating()
    ctrl.interrupt()
    finish = None if case == "requests waiting" else _fresh()
    behind = {"small lag": BS, "no catch-up": lambda: None}.get(case, BS * 128)
    assert ctrl.use_spec(BS, finish, behind=behind) is True


def test_a_bucket_not_warmed_up_borrows_without_pricing():
    """Before both sides are measured there is nothing to price with: the borrowed side."""
    ctrl = AdaptiveSpeculation()
    ctrl.interrupt()
    assert ctrl.use_spec(BS, _fresh(), behind=BS * 128) is True
