"""benchmarks/probe_straggler.py: a pinned run's verifies logged per request, and the finish
estimate replayed over them against the end the run reached."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_straggler  # noqa: E402

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402

CPU = dict(device="cpu", dtype="float32", attention_backend="torch", skip_tokenizer_init=True,
           max_total_tokens=2048, disable_cuda_graph=True)


def test_a_slow_start_makes_the_estimate_miss_what_speculation_would_win():
    """Two requests of 41 tokens: one accepts 5 tokens a verify throughout, the other 1 over its
    first five verifies and 5 after. After call 6, without priors, the estimate prices the
    second at its recent accept length (shrunk toward the pooled 3.0): 18.5 speculative steps,
    18.5 ms against 17.5 ms of plain steps, where it really took 7 more steps (7 ms): a missed
    step. With a batch before it whose four requests accepted 5 tokens a verify, it is shrunk
    toward 5 instead: 12.6 steps, speculation chosen."""
    timelines = {1: [(1, 1)] + [(c, 5) for c in range(2, 10)],
                 2: [(1, 1)] + [(c, 1) for c in range(2, 7)] + [(c, 5) for c in range(7, 14)]}
    spec_s = probe_straggler.step_ms({1: 1.0, 2: 1.0})
    plain_s = probe_straggler.step_ms({1: 0.5, 2: 0.5})
    x = probe_straggler.replay_at(timelines, 6, 41, spec_s, plain_s, [5.0] * 4)
    assert x["running"] == 2 and x["pooled_accept"] == pytest.approx(3.0)
    assert x["least_accept"] == pytest.approx(1.0)
    assert x["est_no_priors_s"] == pytest.approx(35 / (17 / 9) / 1e3)
    assert x["est_first_batch_s"] == x["est_no_priors_s"]  # none finished yet
    assert x["est_spec_s"] == pytest.approx(35 / (25 / 9) / 1e3)
    assert x["true_spec_s"] == pytest.approx(7e-3) and x["plain_s"] == pytest.approx(17.5e-3)
    # The first request finished at call 9 after 8 verifies of 5 tokens and its prefill's one.
    assert probe_straggler.whole_accepts(timelines, 9) == [5.0]
    late = probe_straggler.replay_at(timelines, 10, 41, spec_s, plain_s, [5.0] * 4)
    assert late["running"] == 1
    assert probe_straggler.replay_at(timelines, 13, 41, spec_s, plain_s, []) == {}
    s = probe_straggler.summary([x, late], margin=0.05)
    assert s["replayed"] == 2
    assert s["est_no_priors_missed"] == 1 and s["est_no_priors_wrong_spec"] == 0
    assert s["est_spec_missed"] == 0 and s["est_spec_wrong_spec"] == 0
    # Plain steps at call 6: 17.5 ms where speculation took 7.
    assert s["est_no_priors_lost"] >= (17.5 / 7 - 1) / 2


def test_a_missing_bucket_takes_the_nearest_larger_one():
    at = probe_straggler.step_ms({1: 0.5, 16: 1.0, 64: 2.0})
    assert at(1) == 0.5e-3 and at(3) == 1.0e-3 and at(17) == 2.0e-3 and at(200) == 2.0e-3


def test_a_pinned_run_logs_every_verify_of_every_request(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    out = tmp_path / "straggler.jsonl"
    a = probe_straggler.parse(["--model-path", str(tmp_path), "--batch", "3", "--out", str(out),
                               "--max-new-tokens", "24", "--prompt-len", "32", "--every", "2"])
    lines = probe_straggler.run(a, CPU)
    assert len(out.read_text().splitlines()) == len(lines)
    assert out.with_suffix(".png").stat().st_size > 0
    summary = lines[-1]
    assert summary["probe"] == "straggler_summary" and summary["replayed"] == len(lines) - 1 > 2
    for x in lines[:-1]:
        assert 1 <= x["running"] <= 3 and x["est_spec_s"] > 0 and x["plain_s"] > 0
        assert x["least_accept"] <= x["pooled_accept"]
