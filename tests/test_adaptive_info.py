"""What the adaptive controller reports of each side's window: its step times' spread, which
tells a cold start or a switch left in a side's rate from steady steps (docs/PERFORMANCE.md, "A
drafted engine's neighbour": a plain side measured a fifth slower than it runs)."""

from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.rates import WINDOW, Rate


def test_a_windows_step_times_are_its_least_median_and_most():
    rate = Rate()
    assert rate.step_ms() == []
    for seconds in (0.0012, 0.0009, 0.0030, 0.0010, 0.0011):
        rate.add(1.0, seconds)
    assert rate.step_ms() == [0.9, 1.1, 3.0]


def test_steps_that_left_the_window_leave_its_spread():
    rate = Rate()
    rate.add(1.0, 0.5)  # a cold first step
    for _ in range(WINDOW):
        rate.add(1.0, 0.001)
    assert rate.step_ms() == [1.0, 1.0, 1.0]


def test_the_controllers_info_has_each_sides_spread():
    ctrl = AdaptiveSpeculation()
    for seconds in (0.002, 0.001, 0.001):
        ctrl.record(16, False, 16, seconds)
    info = ctrl.info()["16"]
    assert info["decode_step_ms"] == [1.0, 1.0, 2.0]
    assert info["spec_step_ms"] == []
