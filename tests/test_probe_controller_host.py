"""probe_controller_host times each of the controller's choices and says which steps
speculated and why."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_controller_host as probe  # noqa: E402


def test_round_line_sums_the_calls_and_names_the_speculative_steps():
    log = [{"us": us, "bs": bs, "spec": spec, "why": why} for us, bs, spec, why in
           [(3.0, 4, True, "warm-up"), (250.0, 4, False, "warm-up"), (4.0, 4, False, None),
            (30.0, 2, True, "look")]]
    outs = [{"meta_info": {"plain_decode_tokens": 5}}, {"meta_info": {}}]
    line = probe.round_line(0, log, 0.5, outs, spike_us=20)
    assert line["use_spec_calls"] == 4 and line["use_spec_us"] == 287
    assert line["spikes"] == 2 and line["spike_us"] == 280
    assert line["spec_steps"] == [[0, 4], [3, 2]]
    assert line["switches"] == [[0, "warm-up"], [1, "warm-up"], [3, "look"]]
    assert line["plain_tokens"] == 5


def test_a_run_times_every_decode_choice(tmp_path, capsys):
    out = tmp_path / "lines.jsonl"
    probe.main(["--batch", "2", "--new-tokens", "12", "--rounds", "2", "--out", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1]
    for line in lines:
        # One choice per decode step after the prefill's token, each timed.
        assert line["use_spec_calls"] >= 11 - len(line["spec_steps"]) * 7
        assert line["use_spec_us"] > 0
    # The first batch warms speculation up: its first choice speculates.
    assert lines[0]["spec_steps"][0] == [0, 2]
