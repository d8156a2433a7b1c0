"""benchmarks/probe_compiled_neighbour.py: each case runs an engine, then what it names, then
batches of 8 and of 1, and reports how those went (CPU, the peer run eagerly)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import probe_compiled_neighbour as probe  # noqa: E402

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402

CPU = dict(device="cpu", dtype="float32", attention_backend="torch", skip_tokenizer_init=True,
           max_total_tokens=2048, disable_cuda_graph=True)


def test_each_case_runs_and_reports(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    for case in probe.CASES:
        out = probe.run_case(case, str(tmp_path), CPU, compile_peer=False)
        assert out["case"] == case and out["result"] == "ok", out


def test_a_failed_batch_is_reported_not_raised(tmp_path, monkeypatch):
    save_tiny_checkpoint("llama", tmp_path)
    real, calls = common.generate_ids, []

    def fail_the_batch_of_8(engine, ids, num_new):
        calls.append(len(ids))
        if len(ids) == 8:
            raise AssertionError("short output: [illegal memory access]")
        return real(engine, ids, num_new)

    monkeypatch.setattr(common, "generate_ids", fail_the_batch_of_8)
    out = probe.run_case("empty", str(tmp_path), CPU, compile_peer=False)
    assert out["result"] == "short output: [illegal memory access]" and calls == [1, 8]
