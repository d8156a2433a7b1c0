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
