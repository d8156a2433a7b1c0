"""The trace probes' accounting of kernels launched early (programmatic dependent launch): a
kernel's own time starts where the kernels before it ended, so a step's busy time is the time
some kernel ran, never more than its span."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_decode_trace as trace  # noqa: E402


def test_a_kernel_launched_early_owns_only_the_time_after_the_one_before():
    # b starts 2 us into a (waiting on it), c starts after a gap of 3 us.
    events = [("a", 0.0, 10.0), ("b", 2.0, 14.0), ("c", 17.0, 20.0)]
    own = trace.own_times(events)
    assert own == [("a", 0.0, 10.0), ("b", 10.0, 14.0), ("c", 17.0, 20.0)]
    busy = sum(e - s for _, s, e in own)
    assert busy == 17.0 and busy < sum(e - s for _, s, e in events)


def test_a_kernel_inside_another_owns_nothing_and_order_is_kept():
    # d runs wholly inside a (another stream); a chain of early launches stacks its waits.
    events = [("a", 0.0, 10.0), ("d", 1.0, 4.0), ("e", 3.0, 12.0), ("f", 4.0, 13.0)]
    own = trace.own_times(events)
    assert [n for n, _, _ in own] == ["a", "d", "e", "f"]
    assert [round(e - s, 6) for _, s, e in own] == [10.0, 0.0, 2.0, 1.0]
    assert all(e >= s for _, s, e in own)
    span = max(e for _, _, e in events) - events[0][1]
    assert sum(e - s for _, s, e in own) == span  # no idle time: some kernel always ran


def test_the_window_reports_busy_within_its_span(capsys):
    # Four steps marked by "m", each 10 us of kernels launched early into a 12 us period.
    events = []
    for step in range(5):
        t = step * 12.0
        events += [("m", t, t + 6.0), ("k", t + 1.0, t + 10.0)]
    trace.report_window(events, {"m", "k"}, "m")
    line = capsys.readouterr().out.splitlines()[0]
    assert "3 steps, 12.0 us a step, busy 10.0 us, idle 2.0 us a step" in line, line
