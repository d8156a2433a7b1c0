"""benchmarks/probe_switch.py: the scripted choices and the summary's split of calls by
whether they followed a switch of side."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_switch  # noqa: E402


def test_choices_follow_the_script_whatever_is_measured():
    engine = SimpleNamespace(scheduler=SimpleNamespace(adaptive=SimpleNamespace()))
    probe_switch.script_choices(engine, plain=3, spec=2)
    picks = [engine.scheduler.adaptive.use_spec(16) for _ in range(10)]
    assert picks == [False] * 3 + [True] * 2 + [False] * 3 + [True] * 2


def test_summary_splits_the_first_call_of_each_side_after_a_switch():
    log = [{"kind": "plain", "s": 0.001}, {"kind": "plain", "s": 0.001},
           {"kind": "phase", "phase": "propose", "s": 0.004},
           {"kind": "sync", "s": 0.010}, {"kind": "spec", "s": 0.002},
           {"kind": "plain", "s": 0.003}, {"kind": "plain", "s": 0.001}]
    got = probe_switch.summarize(log)
    assert got["plain"] == {"calls": 3, "mean_ms": pytest.approx(1.0)}
    assert got["sync after switch"] == {"calls": 1, "mean_ms": pytest.approx(10.0)}
    assert got["spec"] == {"calls": 1, "mean_ms": pytest.approx(2.0)}  # same side as sync
    assert got["plain after switch"] == {"calls": 1, "mean_ms": pytest.approx(3.0)}
    assert got["phase propose"]["calls"] == 1


class _Draft:
    """A draft whose path catch-up runs an eager one inside (as HeadDraft's may)."""

    def __init__(self):
        self.calls = []

    def catch_up_to_paths(self, reqs):
        self.calls.append("paths")
        self._eager_catch_up(reqs, [])
        # Its own work far above two eager ones': the cumulative order below does not hang on
        # how long a small loop runs under the profiler.
        return sum(range(200_000))

    def _eager_catch_up(self, reqs, states):
        self.calls.append("eager")
        return sum(range(100))


def test_catchup_probe_times_both_profiles_the_outer_and_unwraps():
    import probe_catchup
    import pstats

    draft = _Draft()
    times, prof = probe_catchup.profile_catch_ups(
        draft, lambda: (draft.catch_up_to_paths([1]), draft._eager_catch_up([1], [])))
    assert [name for name, _ in times] == ["_eager_catch_up", "catch_up_to_paths",
                                           "_eager_catch_up"]
    assert all(ms >= 0 for _, ms in times) and draft.calls == ["paths", "eager", "eager"]
    assert not {"catch_up_to_paths", "_eager_catch_up"} & set(vars(draft))  # unwrapped
    called = {fn for (_, _, fn) in pstats.Stats(prof).stats}
    assert "catch_up_to_paths" in called and "_eager_catch_up" in called
    by_cum = probe_catchup.top(prof, "cumtime", n=3)
    assert by_cum[0][0].endswith("(catch_up_to_paths)") and by_cum[0][1] == 1
    assert by_cum[0][3] >= by_cum[1][3] >= by_cum[2][3]  # cumulative us, largest first


def test_an_untrained_head_is_shaped_for_a_shape_preset():
    """The probes' --untrained head on a random-weight shape (no checkpoint, no staging): its
    checkpoint names the preset's sizes, and an engine on that shape loads it."""
    import json

    from bench_step import random_head_dir

    from specpcg import Engine

    path = random_head_dir("EAGLE3", "shape:smollm2-135m")
    cfg = json.load(open(Path(path) / "config.json"))
    assert cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    engine = Engine(model_path="shape:smollm2-135m", device="cpu", dtype="float32",
                    skip_tokenizer_init=True, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=path, max_total_tokens=512, show_progress=False)
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3})
    assert len(out[0]["output_ids"]) == 3
    engine.shutdown()
