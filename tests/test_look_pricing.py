"""How often adaptive speculation prices the wait before its next look (its host work a step)."""

import pytest

from specpcg.speculative import adaptive
from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.bucket import EXPLORE_EVERY, Bucket
from tests.test_adaptive import _run

LOOK_EVERY = Bucket.look_every  # unwrapped, however many runs count its calls


def _looks_and_pricings(monkeypatch, bs: int) -> tuple:
    """Plain steps 1.8x faster than speculation at batch size bs, a look's wait long for the
    draft's lag (100,000 positions behind): the steps that start a look, and how many times the
    wait was priced (`Bucket.look_every`), over 4,096 steps from a fresh wait."""
    ctrl, priced, picks = AdaptiveSpeculation(), [], []
    _run(ctrl, bs, spec_rate=500, decode_rate=900, steps=200, switch_cost=3.0)
    b = ctrl._buckets[bs]
    b.explore_every, b.since_explore = EXPLORE_EVERY, 0

    def counted(self, spec, batch_size):
        priced.append(batch_size)
        return LOOK_EVERY(self, spec, batch_size)

    monkeypatch.setattr(Bucket, "look_every", counted)
    for _ in range(4096):
        use = ctrl.use_spec(bs, None, 100_000)
        picks.append(use)
        ctrl.record(bs, use, 100, 100 / (500 if use else 900))
    starts = [i for i in range(1, len(picks)) if picks[i] and not picks[i - 1]]
    return starts, len(priced)


@pytest.mark.parametrize("bs", [8, 64])
def test_a_batch_prices_a_long_wait_again_only_part_of_the_way_to_it(monkeypatch, bs):
    """Priced every LOOK_PRICED_EVERY steps, the wait cost 163 pricings here; priced again
    halfway to when it comes due, 16, and the looks start at the same steps."""
    looks, priced = _looks_and_pricings(monkeypatch, bs)
    monkeypatch.setattr(adaptive, "LOOK_PRICED_AHEAD", 0.0)
    looks_often, priced_often = _looks_and_pricings(monkeypatch, bs)
    assert len(looks) >= 2 and looks == looks_often
    assert priced <= 30 and priced_often > 4 * priced, (priced, priced_often)


def test_a_batch_of_one_prices_its_wait_every_few_steps(monkeypatch):
    """A batch of one's looks follow its place in the answer: its wait is priced every
    LOOK_PRICED_EVERY steps whatever LOOK_PRICED_AHEAD says."""
    looks, priced = _looks_and_pricings(monkeypatch, 1)
    monkeypatch.setattr(adaptive, "LOOK_PRICED_AHEAD", 0.0)
    assert (looks, priced) == _looks_and_pricings(monkeypatch, 1)
    assert priced > 100
