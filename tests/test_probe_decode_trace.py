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


def _model(layers: int, hidden: int, inter: int, vocab: int):
    """A stand-in with the weights weight_bytes_in_order reads (bf16, only their shapes)."""
    import torch
    from types import SimpleNamespace as NS

    lin = lambda n, k: NS(weight=torch.empty(n, k, dtype=torch.bfloat16))  # noqa: E731
    layer = NS(self_attn=NS(qkv_proj=lin(3 * hidden, hidden), o_proj=lin(hidden, hidden)),
               mlp=NS(gate_up_proj=lin(2 * inter, hidden), down_proj=lin(hidden, inter)))
    return NS(model=NS(layers=[layer] * layers), head_weight=torch.empty(vocab, hidden,
                                                                         dtype=torch.bfloat16))


def test_matmuls_report_bandwidth_and_the_flop_rate_of_their_rows(capsys):
    # One layer of 64-wide weights and a 128-row head; each matmul takes 2 us of its own time,
    # an RMSNorm between them takes 1 and is not counted.
    model, events, t = _model(1, 64, 128, 128), [], 0.0
    for _ in range(5):
        events += [("_rms_norm_kernel", t, t + 1.0), ("nvjet_sm90_gemm", t + 1.0, t + 3.0)]
        t += 3.0
    own = trace.own_times(events)
    sums = trace.matmul_sums(own, trace.weight_bytes_in_order(model))
    assert sums["qkv"] == [192 * 64 * 2, 2.0] and sums["lm_head"] == [128 * 64 * 2, 2.0]
    trace.print_matmuls(own, model, copy_bps=1e12, rows=512)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# matmuls: 5 kernels for 5 weights, 512 rows a call"
    gate_up = next(line for line in out if line.split()[0] == "gate_up")
    # 256 x 64 bf16 weights read in 2 us: 16.4 GB/s, 0.02 of a 1 TB/s copy; 2 x 512 rows x
    # 16,384 weights in 2 us: 8.4 TFLOP/s.
    assert "16 GB/s (0.02 of copy)" in gate_up and gate_up.endswith(" 8.4 TFLOP/s"), gate_up


def test_matmuls_of_another_count_print_no_kinds(capsys):
    model = _model(1, 64, 128, 128)
    own = [("nvjet_gemm", 0.0, 2.0)] * 3  # a draft head's matmuls among the target's, or fewer
    assert trace.matmul_sums(own, trace.weight_bytes_in_order(model)) == {}
    trace.print_matmuls(own, model, copy_bps=1e12, rows=8)
    out = capsys.readouterr().out.splitlines()
    assert out == ["# matmuls: 3 kernels for 5 weights, 8 rows a call"]


def test_marks_closer_than_a_replays_kernels_are_no_step_period(capsys):
    # The same four 12 us periods, against a replay whose kernels took 30 us: the marker counts
    # something other than steps, and the window prints no period.
    events = []
    for step in range(5):
        t = step * 12.0
        events += [("m", t, t + 6.0), ("k", t + 1.0, t + 10.0)]
    trace.report_window(events, {"m", "k"}, "m", replay_us=30.0)
    out = capsys.readouterr().out.splitlines()
    assert out == ["# window: 3 marks of m, 12.0 us apart, under half a replay's kernels (30 us): "
                   "not a step's period"]
    trace.report_window(events, {"m", "k"}, "m", replay_us=20.0)  # 12 us is over half of 20
    assert "3 steps, 12.0 us a step" in capsys.readouterr().out


def test_step_idle_tells_one_long_wait_from_a_steady_one(capsys):
    from probe_decode_trace import print_step_idle, step_idle

    events = []
    for i in range(6):  # a marker, then one kernel ending 100 us before the next marker
        base = i * 1000.0
        events += [("marker", base, base + 10), ("body", base + 10, base + 900)]
    events[7] = ("body", 3010.0, 3500.0)  # step 3 ends 400 us early
    starts = [i for i, e in enumerate(events) if e[0] == "marker"]
    assert step_idle(events, starts) == [100.0, 100.0, 500.0, 100.0]
    print_step_idle(events, starts)
    assert "median 100.0 us" in capsys.readouterr().out
