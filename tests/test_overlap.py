"""Overlap scheduling (on by default; disable_overlap_schedule turns it off) changes no token:
greedy and seeded outputs, stop strings, EOS, requests arriving while others decode, aborts and
logprob requests, compared token for token with overlap off; every KV slot comes back."""

import pytest
import torch

from specpcg import Engine
from tests.cores import cores_per_worker

PROMPTS = ["The capital of France is", "Count: one, two,", "Water boils at", "Hello"]


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(min(2, cores_per_worker()))
    kw = dict(device="cpu", max_total_tokens=4096, show_progress=False)
    on, off = Engine(**kw), Engine(disable_overlap_schedule=True, **kw)
    assert on.scheduler.overlap is not None and off.scheduler.overlap is None
    yield on, off
    on.shutdown()
    off.shutdown()


def _params():
    return [{"max_new_tokens": 20, "temperature": 0},
            {"max_new_tokens": 7, "temperature": 0, "stop": [","]},
            {"max_new_tokens": 15, "temperature": 0.8, "seed": 3},
            {"max_new_tokens": 1, "temperature": 0}]


def test_batched_outputs_are_the_same_with_and_without_overlap(engines):
    on, off = engines
    a = on.generate(prompt=PROMPTS, sampling_params=_params())
    b = off.generate(prompt=PROMPTS, sampling_params=_params())
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert [o["meta_info"]["finish_reason"] for o in a] == \
        [o["meta_info"]["finish_reason"] for o in b]
    assert on.kv_cache.free_slots == on.kv_cache.total_slots


def _run_arrivals(engine) -> dict:
    """Requests arrive while others decode; one is aborted; one asks for logprobs."""
    rids = [engine.submit(prompt=PROMPTS[0], sampling_params={"max_new_tokens": 24,
                                                              "temperature": 0})]
    outs = {}
    for step in range(40):
        if step == 3:
            rids.append(engine.submit(prompt=PROMPTS[1], sampling_params={
                "max_new_tokens": 10, "temperature": 0}))
        if step == 5:
            rids.append(engine.submit(prompt=PROMPTS[2], return_logprob=True,
                                      sampling_params={"max_new_tokens": 6, "temperature": 0}))
        if step == 6:
            rids.append(engine.submit(prompt=PROMPTS[3], sampling_params={
                "max_new_tokens": 50, "temperature": 0}))
        if step == 9:
            engine.abort(rids[3])
        outs.update({o["meta_info"]["id"]: o for o in engine.step()})
    while engine.has_unfinished():
        outs.update({o["meta_info"]["id"]: o for o in engine.step()})
    return [outs[r] for r in rids]


def test_arrivals_aborts_and_logprobs_change_nothing(engines):
    on, off = engines
    a, b = _run_arrivals(on), _run_arrivals(off)
    for x, y in zip(a[:3], b[:3]):
        assert x["output_ids"] == y["output_ids"]
    assert a[2]["meta_info"]["output_token_logprobs"] == b[2]["meta_info"]["output_token_logprobs"]
    assert a[3]["meta_info"]["finish_reason"]["type"] == "abort"
    assert on.kv_cache.free_slots == on.kv_cache.total_slots
    assert not on.has_unfinished()


def test_overlap_runs_steps_ahead(engines, monkeypatch):
    """The host reads a step's tokens only after the next step was launched."""
    on, _ = engines
    ov = on.scheduler.overlap
    order = []
    real_step, real_resolve = ov.step, ov._resolve
    monkeypatch.setattr(ov, "_resolve", lambda prev: order.append("read") or real_resolve(prev))
    real_forward = on.router.forward
    monkeypatch.setattr(on.router, "forward",
                        lambda b, *a, **k: order.append(b.forward_mode.name) or
                        real_forward(b, *a, **k))
    on.generate(prompt=PROMPTS[0], sampling_params={"max_new_tokens": 5, "temperature": 0})
    del real_step
    # prefill, then each decode is launched before the previous decode's tokens are read
    # (a step left in flight by an earlier test may be read first)
    start = order.index("EXTEND")
    assert order[start:start + 6] == ["EXTEND", "DECODE", "DECODE", "read", "DECODE", "read"]


@pytest.mark.cuda
def test_step_read_waits_for_its_own_step_alone():
    """The read of step n's tokens must not wait for step n + 1, queued behind it on the same
    stream: a plain .tolist() would, and the device would idle while the host prepares the
    step after."""
    from specpcg.transfer import HostCopy

    tokens = torch.arange(4, device="cuda")
    copy = HostCopy(tokens)
    torch.cuda._sleep(1 << 30)  # the next step: about a second of spinning on the device
    assert copy.tolist() == [0, 1, 2, 3]
    assert not torch.cuda.current_stream().query()  # returned while the next step still ran
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_host_copies_take_kept_buffers_in_turn_and_a_stale_read_raises():
    """Copies of one shape reuse KEPT_COPIES pinned buffers in turn: each reads its own values
    while it is among the last KEPT_COPIES of its shape, and a copy older than that raises on
    its read rather than return a newer copy's values."""
    from specpcg.transfer import KEPT_COPIES, HostCopy

    values = [torch.full((3,), i, device="cuda") for i in range(KEPT_COPIES + 1)]
    copies = [HostCopy(v) for v in values]
    for i, copy in enumerate(copies[1:], start=1):
        assert copy.tolist() == [i] * 3
    with pytest.raises(RuntimeError, match="newer copies"):
        copies[0].tolist()
    other = HostCopy(torch.arange(5, device="cuda"))  # another shape: buffers of its own
    assert other.tolist() == list(range(5)) and copies[-1].tolist() == [KEPT_COPIES] * 3
