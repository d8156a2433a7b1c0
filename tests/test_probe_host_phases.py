"""probe_host_phases' timers: every overlapped decode step is counted once, with each phase
inside it, and the tokens stay what an engine without timers gives."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_host_phases as phases  # noqa: E402
from tests.tiny_models import tiny_engine  # noqa: E402

PARAMS = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]


def test_each_overlapped_step_and_its_phases_are_timed_once(tiny_path, monkeypatch):
    want = [o["output_ids"] for o in tiny_engine(tiny_path).generate(
        input_ids=PROMPTS, sampling_params=PARAMS)]
    phases.install_timers(monkeypatch.setattr)
    phases.TIMES.clear()
    engine = tiny_engine(tiny_path)
    got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    assert got == want
    steps = phases.TIMES["step"][0]
    # The prefill gives the first token; the steps the other 8, and one more whose token is
    # dropped (overlap runs a step past a finish before it reads the finish).
    assert steps == PARAMS["max_new_tokens"]
    for name in ("make_batch", "plain_forward", "sample", "host_copy"):
        assert phases.TIMES[name][0] == steps, name
    # every step but the first resolves the one before it; the step past the finish is not read
    assert phases.TIMES["resolve"][0] == phases.TIMES["tolist_wait"][0] == steps - 1
    assert all(secs >= 0 for _, secs in phases.TIMES.values())
    assert phases.TIMES["step"][1] >= phases.TIMES["make_batch"][1]
    line = phases.report("engine 0", [12.0, 13.5])
    assert line.startswith("engine 0: rates 12 14; us a step: step ") and "(1.00)" in line
