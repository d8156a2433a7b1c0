"""host_trace.py's reading of a profiler's events (synthetic ones: no GPU needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from host_trace import graph_leads, report_host  # noqa: E402


def _steps(n: int, lead: float, period: float = 1000.0):
    """n steps: a graph launch at each period's start, its marker kernel `lead` us later, and a
    20 us event wait before each launch."""
    calls, kernels = [], []
    for i in range(n):
        t = i * period
        calls.append(("cudaEventSynchronize", t - 25, t - 5))
        calls.append(("cudaGraphLaunch", t, t + 8))
        kernels.append(("marker", t + lead, t + lead + 3))
        kernels.append(("other", t + lead + 3, t + lead + 900))
    return calls, kernels


def test_each_launch_is_paired_with_the_next_marker_start():
    calls, kernels = _steps(6, lead=12.0)
    assert graph_leads(calls, kernels, "marker") == [12.0] * 6
    calls, kernels = _steps(6, lead=700.0)
    assert graph_leads(calls, kernels, "marker") == [700.0] * 6


def test_a_marker_pairs_with_the_last_launch_before_it():
    calls, kernels = _steps(5, lead=10.0)
    # a prefill's piecewise launches, before the first step: no marker of their own
    calls = [("cudaGraphLaunch", -500.0 + 40 * i, -495.0 + 40 * i) for i in range(4)] + calls
    calls.append(("cudaGraphLaunch", 10_000.0, 10_008.0))  # after the last marker
    assert graph_leads(calls, kernels, "marker") == [10.0] * 5
    assert graph_leads(calls, [("marker", -600.0, -590.0)], "marker") == []


def test_report_counts_calls_and_waits_per_step(capsys):
    calls, kernels = _steps(8, lead=10.0)
    report_host(calls, kernels, "marker")
    out = capsys.readouterr().out
    assert "8 decode steps, 8 graph launches" in out
    wait = next(line for line in out.splitlines() if "cudaEventSynchronize" in line)
    assert wait.split()[:2] == ["1.00", "20.0"] and "(waits)" in wait
    assert "median 10.0 us" in out and "8 of 8 under 30 us" in out


def test_too_few_launches_say_so(capsys):
    report_host(*_steps(2, lead=10.0), "marker")
    assert "only 2 decode steps" in capsys.readouterr().out
