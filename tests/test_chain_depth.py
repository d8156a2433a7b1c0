"""Chain depth per batch size (specpcg/speculative/depth.py): the acceptance shares a truncated
verify still tells, the depth each bucket picks from them and its step times, and, through an
engine, that a chain cut short emits the synchronous loop's tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specpcg.speculative import depth as depth_mod
from specpcg.speculative.depth import (ChainDepth, accept_shares, depth_ladder,
                                       expected_tokens)


def _geometric_hist(share: float, depths: list, n: int, seed: int = 0) -> Counter:
    """Verifies of a chain whose every draft passes with probability `share`, each verified at
    one of `depths` (cut there: it accepts at most that many)."""
    rng, hist = random.Random(seed), Counter()
    for i in range(n):
        d = depths[i % len(depths)]
        m = 0
        while m < d and rng.random() < share:
            m += 1
        hist[(d, m)] += 1
    return hist


def test_ladder_holds_the_full_chain_half_and_one():
    assert depth_ladder(7) == [1, 4, 7]
    assert depth_ladder(3) == [1, 2, 3]
    assert depth_ladder(1) == [1]


def test_shares_are_recovered_from_truncated_verifies():
    """Verifies cut at 1, 4 and 7 drafts together give each draft's pass share: a cut verify
    counts for the drafts it reached, not as a rejection of the ones it never verified."""
    hist = _geometric_hist(0.6, [1, 4, 7], 30000)
    shares = accept_shares(hist, 7)
    assert len(shares) == 7
    assert all(abs(s - 0.6) < 0.03 for s in shares), shares


def test_drafts_not_yet_measured_count_as_accepted():
    """Until enough verifies reached a draft its share is 1, so the whole chain is verified
    (and measured) before a bucket cuts it; once measured, a share keeps its value as decay
    thins its counts."""
    hist = _geometric_hist(0.5, [2], 2000)
    known: set = set()
    shares = accept_shares(hist, 5, known)
    assert shares[2:] == [1.0] * 3 and abs(shares[1] - 0.5) < 0.06
    assert known == {1, 2}
    assert accept_shares(Counter({(7, 0): depth_mod.MIN_REACHED - 1}), 7) == [1.0] * 7
    few = Counter({key: count / 100 for key, count in hist.items()})  # under MIN_REACHED
    assert accept_shares(few, 5, known)[:2] == pytest.approx(shares[:2])
    assert accept_shares(few, 5)[:2] == [1.0, 1.0]


def test_expected_tokens_counts_bonus_and_passing_drafts():
    assert expected_tokens([1.0] * 7, 7) == 8
    assert expected_tokens([0.5] * 7, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.0] * 7, 7) == 1


def _chooser(hist, cost_at_64: dict) -> ChainDepth:
    seconds = {(1, d): 1.0 for d in (1, 4, 7)}  # batch 1: every depth costs a decode step
    seconds.update({(64, d): s for d, s in cost_at_64.items()})
    return ChainDepth(hist, seconds)


def test_small_buckets_verify_everything_large_ones_cut_where_acceptance_is_low():
    """At batch 64 a verify of 7 costs 2.5x one of 1: with drafts that pass 40% of the time a
    depth of 1 emits 1.4 tokens for 1.0 against 1.66 for 2.5, so the chain is cut there; at
    batch 1 every depth costs the same and the whole chain is verified."""
    hist = _geometric_hist(0.4, [7], 2000)
    chooser = _chooser(hist, {1: 1.0, 4: 1.6, 7: 2.5})
    assert chooser.depth(1) == 7
    assert chooser.depth(64) == 1
    high = _chooser(_geometric_hist(0.95, [7], 2000), {1: 1.0, 4: 1.6, 7: 2.5})
    assert high.depth(64) == 7  # 6.0 tokens for 2.5 beats 1.95 for 1.0


def test_no_shares_yet_means_the_full_chain():
    chooser = _chooser(Counter(), {1: 1.0, 4: 1.6, 7: 2.5})
    assert chooser.depth(64) == 7


def test_a_cut_bucket_still_verifies_the_full_chain_now_and_then():
    """Else the shares past the cut would never move again."""
    chooser = _chooser(_geometric_hist(0.3, [7], 2000), {1: 1.0, 4: 1.6, 7: 2.5})
    picks = [chooser.depth(64) for _ in range(2 * depth_mod.EXPLORE_EVERY)]
    assert picks.count(7) == 2 and picks.count(1) == len(picks) - 2


def test_the_pick_follows_acceptance_that_changes():
    """The counts decay (DECAY_AT), so a draft that starts passing takes the bucket back to a
    deep chain (at 97% a depth of 4 and one of 7 emit 3.0 tokens per unit of time alike)."""
    hist = _geometric_hist(0.2, [7], 3000)
    chooser = _chooser(hist, {1: 1.0, 4: 1.6, 7: 2.5})
    assert chooser.depth(64) == 1
    picks = []
    for step in range(100):
        hist.update(_geometric_hist(0.97, [1] * 15 + [7], 64, seed=step))
        picks += [chooser.depth(64) for _ in range(depth_mod.REPICK_EVERY)]
    assert picks[-1] >= 4


def test_a_near_tie_keeps_the_current_depth():
    hist = _geometric_hist(0.5, [7], 4000)
    e1, e4 = expected_tokens(accept_shares(hist, 7), 1), expected_tokens(accept_shares(hist, 7), 4)
    # Depth 4 promises 2% more per second than depth 7 would... set 7's cost so 4 wins by 2%.
    e7 = expected_tokens(accept_shares(hist, 7), 7)
    chooser = _chooser(hist, {1: e1 / 0.5, 4: e4, 7: e7 * 1.02})
    assert chooser.depth(64) == 7


def test_measured_steps_overrule_the_replays():
    """The replays leave out attention over real keys. With shares of 0.7 they favour the whole
    chain at batch 64 (3.1 tokens for 1.75 against 2.8 for 1.6); measured steps of 2.8 at depth
    7 and 1.9 at depth 4 turn that round (1.12 against 1.46 tokens a unit of time)."""
    chooser = _chooser(_geometric_hist(0.7, [7], 4000), {1: 1.0, 4: 1.6, 7: 1.75})
    assert chooser.depth(64) == 7
    for _ in range(depth_mod.MIN_MEASURED):
        chooser.observe(64, 7, 2.8)
        chooser.observe(64, 4, 1.9)
    assert chooser.seconds(64, 7) == pytest.approx(2.8)
    for _ in range(depth_mod.REPICK_EVERY - 1):
        chooser.depth(64)
    assert chooser.depth(64) == 4
    assert chooser.info()["measured_step_ms"] == {"64x4": 1900.0, "64x7": 2800.0}


def test_an_unmeasured_depth_takes_its_replay_scaled_as_the_measured_ones_ran():
    """Depth 7 ran 1.4x its replay, so depth 1 is estimated at 1.4x its own; too few measured
    steps count for nothing, and a depth that ran faster than its replay counts as 1x."""
    chooser = _chooser(Counter(), {1: 1.0, 4: 1.6, 7: 2.0})
    chooser.observe(64, 7, 2.8)
    assert chooser.seconds(64, 1) == pytest.approx(1.0)  # one step is not a measurement
    for _ in range(depth_mod.MIN_MEASURED):
        chooser.observe(64, 7, 2.8)
    assert chooser.seconds(64, 1) == pytest.approx(1.4)
    assert chooser.seconds(64, 4) == pytest.approx(1.6 * 1.4)
    assert chooser.seconds(1, 1) == pytest.approx(1.0)  # another bucket's steps do not count
    for _ in range(depth_mod.MIN_MEASURED):
        chooser.observe(64, 1, 0.5)
    assert chooser.seconds(64, 4) == pytest.approx(1.6 * 1.2)  # the median of 1.4 and 1


def test_the_timer_gives_each_step_the_interval_it_ended():
    """Calls start at 0, 1, 3, 4, 6: with the device busy, the interval between the calls that
    launch steps k + 1 and k + 2 is step k's. A reset (a flush) and a new bucket break the run."""
    timer = depth_mod.StepTimer()
    assert timer.launched(0.0, 64, 8) is None
    assert timer.launched(1.0, 64, 5) is None
    assert timer.launched(3.0, 64, 8) == (64, 8, 2.0)
    assert timer.launched(4.0, 64, 8) == (64, 5, 1.0)
    timer.reset()
    assert timer.launched(6.0, 64, 8) is None
    assert timer.launched(7.0, 64, 8) is None
    assert timer.launched(8.0, 48, 8) is None  # the batch shrank: its steps are not 64's
    assert timer.launched(9.0, 48, 8) is None
    assert timer.launched(10.5, 48, 8) == (48, 8, 1.5)


@pytest.mark.parametrize("replays,measured_full,want", [
    ({1: 1.146, 4: 1.412, 7: 1.576}, 1.989, 7),  # default model: the host sets the pace
    ({1: 7.326, 4: 10.155, 7: 12.985}, 15.972, 4),  # 8B shape: the verify's rows do
], ids=["default", "8b"])
def test_h100_batch_64_picks_from_the_measured_full_chain(replays, measured_full, want):
    """Batch 64 at p = 0.7 with the step times the H100 gave (a44372f: the capture's replays,
    then the whole chain as run): the 8B shape cuts to 4 drafts, the default model keeps 7
    (a surplus per verified row had estimated its depth 4 at 1.67 ms where it ran 1.83)."""
    seconds = {(1, d): 1.0 for d in (1, 4, 7)}
    seconds.update({(64, d): s for d, s in replays.items()})
    chooser = ChainDepth(_geometric_hist(0.7, [7], 4000), seconds)
    for _ in range(depth_mod.MIN_MEASURED):
        chooser.observe(64, 7, measured_full)
    assert chooser.depth(64) == want
