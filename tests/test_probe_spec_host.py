"""benchmarks/probe_spec_host.py: its engine's overlapped steps run no forward, yet the host
does a whole step's work on results where every draft was accepted."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_spec_host  # noqa: E402


def test_each_overlapped_step_emits_every_node_of_the_stub_results():
    from specpcg.scheduler import Scheduler
    from tests.tiny_models import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as path:
        save_tiny_checkpoint("llama", path)
        engine = probe_spec_host.spec_engine(path, 2, 4)
        calls, real = [], Scheduler._run_spec_overlapped
        Scheduler._run_spec_overlapped = lambda self: calls.append(1) or real(self)
        try:
            outs = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={
                "max_new_tokens": 13, "temperature": 0, "ignore_eos": True})
        finally:
            Scheduler._run_spec_overlapped = real
    # the prefill's token, then 3 steps of the stub's nodes 4, 5, 6 and bonus 3; one call more
    # than the steps reads the last
    assert [o["output_ids"][1:] for o in outs] == [[4, 5, 6, 3] * 3] * 2
    assert len(calls) == 4


def test_a_run_reports_a_host_time_a_batch_size():
    records = probe_spec_host.main(["--batches", "1", "2", "--steps", "3", "--tokens", "4",
                                    "--repeats", "1"])
    assert [r["batch_size"] for r in records] == [1, 2]
    assert all(r["host_us_per_step"] > 0 and r["tokens_per_step"] == 4 for r in records)


def test_adaptive_runs_its_controller_and_shadow_verifies_on_the_same_stub_steps():
    records = probe_spec_host.main(["--batches", "2", "--steps", "3", "--tokens", "4",
                                    "--repeats", "1", "--adaptive"])
    assert [(r["batch_size"], r["adaptive"]) for r in records] == [(2, True)]
    assert records[0]["host_us_per_step"] > 0
