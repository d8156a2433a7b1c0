"""Adaptive speculation's re-choice on the finish estimate: how often it walks the batch."""

from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.finish import Finish
from tests.test_adaptive import _warm


def test_a_settled_choice_builds_the_finish_estimate_ever_more_rarely():
    """Plain steps 40% ahead: each re-choice that keeps them doubles the wait before the next
    estimate (16, 32, ... up to REDECIDE_MAX_EVERY, 256), so a settled batch of 64 walks its
    requests every 256 steps; a turn in the estimate still turns the choice within that many,
    and a re-choice that turns the side sets the wait back to REDECIDE_EVERY."""
    from specpcg.speculative.adaptive import REDECIDE_MAX_EVERY

    from specpcg.speculative.bucket import EXPLORE_MAX_EVERY

    ctrl = AdaptiveSpeculation()
    _warm(ctrl, 64, spec_step_s=2.8, accept=2.0, plain_step_s=1.0)
    b = ctrl._buckets[64]
    b.explore_every = EXPLORE_MAX_EVERY  # looks confirmed long ago: none in this test
    even = Finish(remaining=(200,) * 64, spec_tokens=(200,) * 64, verifies=(100,) * 64)
    fast = Finish(remaining=(200,) * 64, spec_tokens=(500,) * 64, verifies=(100,) * 64)
    built, current = [], [even]

    def finish():
        built.append(len(picks))
        return current[0]

    picks: list = []
    assert REDECIDE_MAX_EVERY == 256
    for _ in range(1 + 16 + 32 + 64 + 128 + 256 + 256):
        picks.append(ctrl.use_spec(64, finish))
    assert not any(picks)
    # the warm-up's rates chose plain steps too: 16 at once
    assert built == [0, 16, 48, 112, 240, 496, 752]
    current[0] = fast  # 5 tokens a verify: speculation now ends the batch far sooner
    for _ in range(REDECIDE_MAX_EVERY):
        picks.append(ctrl.use_spec(64, finish))
    assert picks[-1] is True and built[7:] == [1008]
    assert b.redecide_every == 0  # the side turned: back to every REDECIDE_EVERY steps


def test_with_shadow_verifies_a_settled_choice_is_priced_again_every_few_steps():
    """Shadow verifies measure the draft's acceptance on every plain step, and it drifts along
    an answer (NGRAM on chat: low at its start, higher later), so a bucket they price never
    stretches its wait: the estimate comes every REDECIDE_EVERY steps, and a rise in the
    shadow's acceptance turns a settled plain choice within that many steps."""
    from specpcg.speculative.bucket import EXPLORE_MAX_EVERY, REDECIDE_EVERY

    ctrl = AdaptiveSpeculation()
    ctrl.shadow(1.1)
    _warm(ctrl, 1, spec_step_s=1.6, accept=1.1, plain_step_s=1.0)
    b = ctrl._buckets[1]
    b.explore_every = EXPLORE_MAX_EVERY
    low = Finish(remaining=(200,), spec_tokens=(33,), verifies=(30,))
    high = Finish(remaining=(200,), spec_tokens=(90,), verifies=(30,))
    built, current, picks = [], [low], []

    def finish():
        built.append(len(picks))
        return current[0]

    for _ in range(1 + 8 * REDECIDE_EVERY):
        picks.append(ctrl.use_spec(1, finish))
    assert not any(picks)
    assert built == [REDECIDE_EVERY * k for k in range(9)]
    assert b.redecide_every == 0
    current[0] = high  # 3 tokens a verify: speculation now ends the request far sooner
    ctrl.shadow(3.0)
    for _ in range(REDECIDE_EVERY):
        picks.append(ctrl.use_spec(1, finish))
    assert picks[-1] is True
