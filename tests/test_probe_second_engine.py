"""benchmarks/probe_second_engine.py: how it reads a batch against decoding alone
(tests.matrix_common.first_divergence), and one run on the CPU, where a batch keeps every output
of decoding alone."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_second_engine  # noqa: E402


def test_first_divergence_names_the_first_token_that_differs():
    from tests.matrix_common import first_divergence

    alone = [[5, 6, 7], [5, 6, 7], [5, 6], [5, 6, 7]]
    batched = [[5, 6, 7], [5, 9, 7], [5, 6, 2], [5, 6]]
    # identical; differs at 1; the batch ran on past alone's end; the batch stopped early
    assert [first_divergence(b, a) for a, b in zip(alone, batched)] == [None, 1, 2, 2]


def test_a_cpu_run_after_moving_request_ids_on_reports_every_output_identical():
    from specpcg import core

    before = next(core._request_ids)
    line = probe_second_engine.worker({"before": "ids", "prompts": 2, "tokens": 3,
                                       "device": "cpu", "attention_backend": "torch"})
    assert line["identical"] == 2 and line["first_difference"] == [None, None]
    assert line["batched_head"] == line["alone_head"] and len(line["alone_head"]) >= 1
    assert line["arrival_counters_nonzero"] is None  # a CPU engine never makes them
    assert next(core._request_ids) >= before + 1 + 4 + 2 * 2  # 4 skipped, 2 alone, 2 batched
