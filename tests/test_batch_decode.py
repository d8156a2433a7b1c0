"""benchmarks/common.batch_decode: a batch's decode measured from its last first token, and the
step time of the request that finished first (no engine: meta_info as the engine writes it)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402


def _meta(ttft, e2e, tokens, verify=0, plain=0):
    meta = {"ttft": ttft, "e2e_latency": e2e, "completion_tokens": tokens}
    if verify or plain:
        meta.update(spec_verify_ct=verify, plain_decode_tokens=plain)
    return meta


def test_decode_starts_at_the_last_prefill_of_the_batch():
    # Four prompts prefilled one after another (10 ms each), then 9 steps of 2 ms together:
    # the first request waited 30 ms for the others' prefill before it decoded.
    metas = [_meta(0.010 * (i + 1), 0.040 + 0.018, 10) for i in range(4)]
    out = common.batch_decode(metas)
    assert out["itl_s"] == pytest.approx(0.002)
    assert out["step_s"] == pytest.approx(0.002)
    assert out["tokens_per_step"] == pytest.approx(1.0)
    # The old window, from the slowest's own first token, charged it the others' prefill.
    slowest = metas[0]
    assert (slowest["e2e_latency"] - slowest["ttft"]) / 9 == pytest.approx(0.00533, rel=1e-2)


def test_the_step_time_comes_from_the_request_that_finished_first():
    # Speculative steps of 3 ms at the whole batch: the lucky request is done after 4 verifies
    # (8 tokens after its first); the unlucky one needs 7 more, the last 3 of them alone
    # and faster (1 ms), so its own time per step is lower than the batch's.
    lucky = _meta(0.010, 0.010 + 4 * 0.003, 9, verify=4)
    unlucky = _meta(0.010, 0.010 + 4 * 0.003 + 3 * 0.001, 9, verify=7)
    out = common.batch_decode([unlucky, lucky])
    assert out["step_s"] == pytest.approx(0.003)
    assert out["tokens_per_step"] == pytest.approx(2.0)
    assert out["itl_s"] == pytest.approx((4 * 0.003 + 3 * 0.001) / 8)


def test_plain_steps_of_an_adaptive_engine_are_steps():
    meta = _meta(0.0, 0.010, 11, verify=2, plain=6)
    assert common.decode_steps(meta) == 8
    assert common.decode_steps(_meta(0.0, 0.010, 11)) == 10
