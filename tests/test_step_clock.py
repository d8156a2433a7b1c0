"""The decode steps' clock (specpcg/speculative/step_clock.py) feeding the adaptive controller:
a steady plain step that only joins its window (`AdaptiveSpeculation.record`'s shortcut) leaves
the controller where the whole `record` would have."""

import random
from types import SimpleNamespace

import pytest

from specpcg.speculative import step_clock
from specpcg.speculative.adaptive import AdaptiveSpeculation
from specpcg.speculative.step_clock import StepClock


class _Time:
    """A clock the test moves by hand (perf_counter's stand-in)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _WholeRecord(AdaptiveSpeculation):
    """The controller without its steady shortcut: every step takes the whole record."""

    def record(self, *args) -> None:
        self._steady = None
        super().record(*args)


def _state(ctrl: AdaptiveSpeculation) -> dict:
    sides = {key: (list(b.decode.recent), b.decode.steps, list(b.spec.recent), b.spec.steps)
             for key, b in ctrl._buckets.items()}
    return {"sides": sides, "chosen": dict(ctrl.chosen), "switched": dict(ctrl.switched)}


@pytest.mark.parametrize("seed", range(4))
def test_the_steady_path_keeps_the_controllers_every_window_and_choice(monkeypatch, seed):
    """Prefills, flushed switches and batches that shrink and grow among 600 steps; each step
    asks both controllers for its side, runs it for seconds drawn for that side and batch, and
    tells its clock. Both choose alike at every step and end with the same windows."""
    fake, rng = _Time(), random.Random(seed)
    monkeypatch.setattr(step_clock, "time", fake)
    clocks = [StepClock(SimpleNamespace(adaptive=cls()))
              for cls in (AdaptiveSpeculation, _WholeRecord)]
    bs, fast_steps = 4, 0
    for _ in range(600):
        if rng.random() < 0.03:
            for clock in clocks:
                clock.prefill()
            bs = rng.choice((1, 2, 3, 4, 8, 16))
        choices = {c.scheduler.adaptive.use_spec(bs, behind=0) for c in clocks}
        assert len(choices) == 1
        speculate, start = choices.pop(), fake.now
        if rng.random() < 0.05:  # a switch reads the other side's step in flight first
            fake.now += rng.uniform(1e-4, 3e-3)
            carried = [SimpleNamespace(output_ids=[0] * rng.randint(1, 3)) for _ in range(bs)]
            for clock in clocks:
                clock.flushed(not speculate, carried, bs)
        fake.now += rng.uniform(2e-4, 6e-4) * (3.0 if speculate else 1.0) * (1 + bs / 16)
        steady = clocks[0].scheduler.adaptive._steady
        fast_steps += steady is not None and steady[0] == bs and not speculate
        tokens = bs * (rng.randint(1, 5) if speculate else 1)
        for clock in clocks:
            clock.record(bs, speculate, tokens, start)
            clock.step_done()
    assert fast_steps > 200  # the shortcut ran
    assert _state(clocks[0].scheduler.adaptive) == _state(clocks[1].scheduler.adaptive)


def test_a_prefill_tells_the_controller_and_ends_the_steady_run(monkeypatch):
    """After a prefill the next plain step is not counted: the controller's steady shortcut
    must not add it to its window."""
    fake = _Time()
    monkeypatch.setattr(step_clock, "time", fake)
    ctrl = AdaptiveSpeculation()
    clock = StepClock(SimpleNamespace(adaptive=ctrl))
    for _ in range(3):
        start, fake.now = fake.now, fake.now + 1e-3
        clock.record(2, False, 2, start)
        clock.step_done()
    window = ctrl._bucket(2).decode
    assert ctrl._steady == (2, window) and window.steps == 3
    clock.prefill()
    start, fake.now = fake.now, fake.now + 1e-3
    clock.record(2, False, 2, start)
    assert window.steps == 3 and ctrl._steady is None
