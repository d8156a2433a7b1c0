"""A side's window (specpcg/speculative/rates.Rate): its sums, kept as steps come and go, are
the window's own, as computed from its steps afresh."""

import random
from collections import deque

import pytest

from specpcg.speculative.rates import OUTLIER_FACTOR, TRIM_DIV, WINDOW, Rate


def _afresh(recent: deque) -> tuple:
    """(tokens, seconds, steps) from the window's steps alone (Rate._totals' definition)."""
    n, times = len(recent), sorted(s for _, s in recent)
    slow = sum(s > OUTLIER_FACTOR * times[n // 2] for s in times) if n >= 3 else 0
    kept = times[:n - min(slow, -(-n // TRIM_DIV))]
    seconds = sum(kept) * n / len(kept) if kept else 0.0
    return sum(t for t, _ in recent), seconds, n


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_sums_are_the_windows_own(seed):
    """Steps of repeated times, hiccups 3-20x the usual, and looks that restart the window,
    over several windows' worth of steps: after every step the sums equal those computed from
    the window afresh, bit for bit."""
    rng, rate = random.Random(seed), Rate()
    usual = [1e-3, 1.1e-3, 1.25e-3]
    for step in range(5 * WINDOW):
        seconds = rng.choice(usual) * (rng.choice((3, 20)) if rng.random() < 0.1 else 1)
        rate.add(rng.choice((1.0, 2.0, 2.5)), seconds)
        if rng.random() < 0.05:  # a look 100x faster: the speed changed, its steps are kept
            for _ in range(2):
                rate.add(4.0, 1e-5)
            rate.restart_if_changed(2)
        assert rate._totals() == _afresh(rate.recent)
        assert rate.step_ms() == [round(1e3 * t, 3) for t in (
            min(s for _, s in rate.recent), sorted(s for _, s in rate.recent)[
                len(rate.recent) // 2], max(s for _, s in rate.recent))]
    assert rate.steps >= 5 * WINDOW and len(rate.recent) <= WINDOW
