"""benchmarks/bench_accept.py part B's records: no-spec runs first and last, and each batch
size's baseline is the faster pass."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_accept  # noqa: E402


def _measure(tok_s: float, batch: int, accept_length: float = 1.0) -> dict:
    step_ms = 1000 * batch * accept_length / tok_s
    return {"decode_tok_s": tok_s, "step_ms": step_ms, "accept_length": accept_length,
            "accept_length_engine": accept_length}


def test_the_faster_no_spec_pass_is_the_baseline_of_every_p():
    args = argparse.Namespace(no_stack_nodes=False)
    measured = [(None, 1, _measure(1300.0, 1)), (None, 4, _measure(5000.0, 4)),
                (1.0, 1, _measure(10400.0, 1, 8.0)), (1.0, 4, _measure(30000.0, 4, 8.0)),
                (None, 1, _measure(2000.0, 1)), (None, 4, _measure(4000.0, 4))]
    records = bench_accept.b_records(args, bench_accept.Settings(), "m", {}, measured)
    by = {(r["prob"], r["batch_size"]): r for r in records}
    assert len(records) == 4  # one no-spec record a batch size
    assert by[None, 1]["decode_tok_s"] == 2000.0  # the last pass, the faster at batch 1
    assert by[None, 1]["nospec_tok_s_passes"] == [1300.0, 2000.0]
    assert by[None, 4]["decode_tok_s"] == 5000.0  # the first, the faster at batch 4
    assert abs(by[1.0, 1]["speedup"] - 5.2) < 1e-9
    assert abs(by[1.0, 1]["efficiency"] - 0.65) < 1e-9  # 0.5 ms against 0.769 ms a step
    assert abs(by[1.0, 4]["efficiency"] - 0.75) < 1e-9
