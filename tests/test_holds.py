"""The diagnostic holds of an adaptive engine (benchmarks/holds.py) change what they say."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import holds  # noqa: E402
import specpcg.speculative.adaptive as adaptive  # noqa: E402


def _engine():
    calls = []

    def use_spec(batch_size, finish=None, behind=None, position=None):
        calls.append(batch_size)
        return True
    ctrl = SimpleNamespace(use_spec=use_spec)
    return SimpleNamespace(scheduler=SimpleNamespace(adaptive=ctrl)), calls


def test_then_plain_asks_the_controller_for_a_sizes_first_steps_only():
    engine, calls = _engine()
    holds.then_plain(engine, chosen_steps=3)
    use = engine.scheduler.adaptive.use_spec
    assert [use(64) for _ in range(5)] == [True, True, True, False, False]
    assert len(calls) == 3  # not asked once past its steps
    assert all(use(16) for _ in range(5)) and len(calls) == 8  # small batches always ask


def test_lean_prices_a_look_when_due_and_rechooses_seldom(monkeypatch):
    monkeypatch.setattr(adaptive, "LOOK_PRICED_EVERY", adaptive.LOOK_PRICED_EVERY)
    monkeypatch.setattr(adaptive, "REDECIDE_MAX_EVERY", adaptive.REDECIDE_MAX_EVERY)
    holds.lean(None)
    assert adaptive.LOOK_PRICED_EVERY >= 1 << 20 and adaptive.REDECIDE_MAX_EVERY == 1024
