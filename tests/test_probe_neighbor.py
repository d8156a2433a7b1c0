"""benchmarks/probe_neighbor.py: the first engine's rounds alone, beside a second engine and
after it closes, with the host's timings of the decode graph runner's calls."""

import sys

import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_clock_times_each_call_and_puts_the_runner_back(monkeypatch):
    import time

    import probe_neighbor
    from specpcg.graphs.decode_runner import DecodeGraphRunner

    def fake_forward(runner, batch):
        time.sleep(0.002)
        return batch * 2

    monkeypatch.setattr(DecodeGraphRunner, "forward", fake_forward)
    with probe_neighbor.ForwardClock(cuda=False) as clock:
        outs = [DecodeGraphRunner.forward(None, i) for i in range(8)]
    assert outs == [2 * i for i in range(8)]  # the real call's result passes through
    assert DecodeGraphRunner.forward is fake_forward
    assert len(clock.calls) == 8
    m = clock.medians()
    assert set(m) == {"host_in_call_us", "host_call_to_call_us"}  # no device columns on CPU
    # every call sleeps 2 ms, and a call starts after the one before it ended
    assert m["host_in_call_us"] >= 2000 and m["host_call_to_call_us"] >= 2000


def test_the_first_engine_runs_alone_beside_a_drafted_one_and_after_it_closed(tmp_path):
    import probe_neighbor
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    out = tmp_path / "neighbor.jsonl"
    lines = probe_neighbor.main(
        ["--model-path", str(tmp_path), "--second", "pinned", "--algorithm", "STANDALONE",
         "--batch", "2", "--max-new-tokens", "6", "--rounds", "1", "--close", "--device", "cpu",
         "--second-kw", "disable_overlap_schedule=true", "--out", str(out)],
        extra={"dtype": "float32", "skip_tokenizer_init": True})
    assert [line["stage"] for line in lines] == ["alone", "beside pinned", "pinned closed"]
    assert all(line["tok_s"] > 0 and line["second"] == "pinned" for line in lines)
    assert all(line["second_kw"] == {"disable_overlap_schedule": True} for line in lines)
    assert all(line["context_limits"] == {} for line in lines)  # no CUDA context here
    assert len(out.read_text().splitlines()) == 3


def test_second_engine_arguments_parse_to_their_types():
    import pytest

    import probe_neighbor

    assert probe_neighbor.parse_kw(["disable_cuda_graph=true", "cuda_graph_max_bs=8",
                                    "mem_fraction_static=0.5", "attention_backend=triton"]) == {
        "disable_cuda_graph": True, "cuda_graph_max_bs": 8, "mem_fraction_static": 0.5,
        "attention_backend": "triton"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        probe_neighbor.parse_kw(["disable_cuda_graph"])


def test_the_second_engine_built_first_leaves_no_round_alone(tmp_path):
    import probe_neighbor
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    lines = probe_neighbor.main(
        ["--model-path", str(tmp_path), "--second", "no-spec", "--second-first", "--batch", "2",
         "--max-new-tokens", "4", "--rounds", "2", "--device", "cpu"],
        extra={"dtype": "float32", "skip_tokenizer_init": True})
    assert [line["stage"] for line in lines] == ["built after no-spec"] * 2
    assert all(line["second_first"] and line["algorithm"] is None for line in lines)


def test_recapture_names_an_engine_without_decode_graphs():
    from types import SimpleNamespace

    import pytest

    import probe_neighbor

    engine = SimpleNamespace(graphs=SimpleNamespace(decode=None), device="cpu")
    with pytest.raises(SystemExit, match="no decode graphs"):
        probe_neighbor.recapture(engine)
    captured = []
    engine.graphs.decode = SimpleNamespace(capture=lambda: captured.append(True))
    probe_neighbor.recapture(engine)
    assert captured == [True]


def test_a_drafted_engine_held_alone_takes_plain_steps_only(tmp_path):
    import probe_neighbor
    from tests.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama", tmp_path)
    base = ["--model-path", str(tmp_path), "--algorithm", "STANDALONE", "--held-alone",
            "--batch", "2", "--max-new-tokens", "5", "--rounds", "1", "--device", "cpu"]
    extra = {"dtype": "float32", "skip_tokenizer_init": True}
    lines = probe_neighbor.main(base + ["--second", "adaptive"], extra=extra)
    assert [line["stage"] for line in lines] == ["held plain, alone"]
    assert lines[0]["held_alone"] and lines[0]["algorithm"] == "STANDALONE"
    assert lines[0]["verifies"] == 0  # plain steps only
    with pytest.raises(SystemExit, match="no adaptive controller"):
        probe_neighbor.main(base + ["--second", "pinned"], extra=extra)
