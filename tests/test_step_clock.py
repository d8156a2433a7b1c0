"""The decode steps' clock (specpcg/speculative/step_clock.py): a steady plain step added to
its window by the clock itself leaves the controller where its whole `record` would have."""

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


class _SlowClock(StepClock):
    """The clock without its steady path: every step goes through the controller's record."""

    def record(self, *args) -> None:
        self.steady = None
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
    clocks = [cls(SimpleNamespace(adaptive=AdaptiveSpeculation()))
              for cls in (StepClock, _SlowClock)]
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
        fast_steps += clocks[0].steady is not None and not speculate
        tokens = bs * (rng.randint(1, 5) if speculate else 1)
        for clock in clocks:
            clock.record(bs, speculate, tokens, start)
            clock.step_done()
    assert fast_steps > 200  # the steady path ran
    assert _state(clocks[0].scheduler.adaptive) == _state(clocks[1].scheduler.adaptive)


def test_a_prefill_tells_the_controller_and_ends_the_steady_run(monkeypatch):
    """After a prefill the next plain step is not counted: the clock's steady path must not
    add it behind the controller's back."""
    fake = _Time()
    monkeypatch.setattr(step_clock, "time", fake)
    ctrl = AdaptiveSpeculation()
    clock = StepClock(SimpleNamespace(adaptive=ctrl))
    for _ in range(3):
        start, fake.now = fake.now, fake.now + 1e-3
        clock.record(2, False, 2, start)
        clock.step_done()
    window = ctrl._bucket(2).decode
    assert clock.steady == (2, window) and window.steps == 3
    clock.prefill()
    start, fake.now = fake.now, fake.now + 1e-3
    clock.record(2, False, 2, start)
    assert window.steps == 3 and clock.steady is None
