"""Engine API under the server, on CPU: streaming, async_generate, abort, a failed forward that
ends only its own requests, and the input fixes (inf temperature, unknown device names, a
max_new_tokens past the context)."""

import asyncio

import pytest
import torch

from specpcg import Engine
from test_train import _tiny_target  # noqa: F401
from tests.cores import cores_per_worker

GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(min(2, cores_per_worker()))
    eng = Engine(device="cpu", max_total_tokens=4096, show_progress=False)
    yield eng
    eng.shutdown()


def test_streamed_deltas_add_up_to_the_output(engine):
    full = engine.generate(prompt="The capital of France is", sampling_params=GREEDY)
    chunks = list(engine.generate(prompt="The capital of France is", sampling_params=GREEDY,
                                  stream=True))
    assert "".join(c["delta"] for c in chunks) == full["text"]
    assert sum(len(c["delta_ids"]) for c in chunks) == 16
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    with pytest.raises(ValueError, match="submit takes one request"):
        engine.generate(prompt=["a", "b"], stream=True)


def test_a_stream_closed_early_aborts_and_frees(engine):
    total = engine.kv_cache.total_slots
    stream = engine.generate(prompt="Once upon a time", stream=True,
                             sampling_params={"max_new_tokens": 200, "temperature": 0})
    next(stream), next(stream)
    assert engine.kv_cache.free_slots < total
    stream.close()
    assert engine.kv_cache.free_slots == total and not engine.has_unfinished()


def test_abort_ends_a_request_and_leaves_the_others(engine):
    keep = engine.submit(prompt="One, two, three,", sampling_params=GREEDY)
    drop = engine.submit(prompt="Water boils at", sampling_params={"max_new_tokens": 200})
    engine.step()
    assert engine.abort(drop) and not engine.abort(10 ** 9)
    outs = {}
    while engine.has_unfinished():
        outs.update({o["meta_info"]["id"]: o for o in engine.step()})
    assert outs[drop]["meta_info"]["finish_reason"]["type"] == "abort"
    solo = engine.generate(prompt="One, two, three,", sampling_params=GREEDY)
    assert outs[keep]["output_ids"] == solo["output_ids"]
    assert engine.kv_cache.free_slots == engine.kv_cache.total_slots


def test_async_generate_matches_generate(engine):
    want = [engine.generate(prompt=p, sampling_params=GREEDY)["text"] for p in ("a", "b c")]

    async def run():
        outs = await asyncio.gather(*[engine.async_generate(prompt=p, sampling_params=GREEDY)
                                      for p in ("a", "b c")])
        it = await engine.async_generate(prompt="a", sampling_params=GREEDY, stream=True)
        text = "".join([c["delta"] async for c in it])
        return [o["text"] for o in outs], text

    got, streamed = asyncio.run(run())
    assert got == want and streamed == want[0]


def test_a_reader_that_falls_behind_gets_merged_chunks_with_every_token(engine):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = engine.generate(prompt="Once upon a time", sampling_params=params)

    async def slow_reader():
        chunks = []
        async for chunk in await engine.async_generate(prompt="Once upon a time",
                                                       sampling_params=params, stream=True):
            chunks.append(chunk)
            await asyncio.sleep(0.2)  # several engine steps go by while it sleeps
        return chunks

    chunks = asyncio.run(slow_reader())
    assert len(chunks) < 24  # fewer events than tokens: the waiting ones came merged
    assert [t for c in chunks for t in c["delta_ids"]] == full["output_ids"]
    assert "".join(c["delta"] for c in chunks) == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]


def test_merge_chunks_joins_the_deltas_and_keeps_the_last_output():
    from specpcg.engine_thread import merge_chunks

    a = {"delta": "Hel", "delta_ids": [1], "text": None, "meta_info": {"finish_reason": None}}
    b = {"delta": "lo", "delta_ids": [2, 3], "text": "Hello",
         "meta_info": {"finish_reason": {"type": "length"}}}
    merged = merge_chunks([a, b])
    assert merged["delta"] == "Hello" and merged["delta_ids"] == [1, 2, 3]
    assert merged["text"] == "Hello" and merged["meta_info"]["finish_reason"]["type"] == "length"
    assert merge_chunks([a]) is a


def test_a_failed_forward_ends_only_the_requests_it_carried(engine, monkeypatch):
    running = [engine.submit(prompt=p, sampling_params=GREEDY) for p in ("a b", "c d")]
    engine.step()  # both prefilled: they decode from now on
    real = engine.router.forward
    calls = []

    def forward(batch, *a, **kw):
        if batch.forward_mode.name == "EXTEND":
            calls.append(batch)
            raise RuntimeError("injected fault")
        return real(batch, *a, **kw)

    monkeypatch.setattr(engine.router, "forward", forward)
    bad = engine.submit(prompt="fails", sampling_params=GREEDY)
    outs = {}
    outs.update({o["meta_info"]["id"]: o for o in engine.step()})  # the new prefill fails
    monkeypatch.undo()
    assert calls and outs[bad]["meta_info"]["finish_reason"] == {
        "type": "error", "message": "RuntimeError: injected fault"}
    while engine.has_unfinished():
        outs.update({o["meta_info"]["id"]: o for o in engine.step()})
    for rid, p in zip(running, ("a b", "c d")):
        assert outs[rid]["output_ids"] == engine.generate(prompt=p, sampling_params=GREEDY)[
            "output_ids"]
    assert engine.kv_cache.free_slots == engine.kv_cache.total_slots


def test_infinite_temperature_and_unknown_devices_are_value_errors(engine):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got inf"):
        engine.generate(prompt="a", sampling_params={"temperature": float("inf")})
    with pytest.raises(ValueError, match="device 'tpu9'"):
        Engine(device="tpu9")


def test_a_length_cut_by_the_context_says_so(tmp_path):
    eng = Engine(model_path=_tiny_target(tmp_path / "t"), skip_tokenizer_init=True,
                 device="cpu", dtype="float32", context_length=32, show_progress=False)
    out = eng.generate(input_ids=[5] * 20, sampling_params={"max_new_tokens": 10 ** 9,
                                                            "temperature": 0})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "length" and "context_length 32 reached" in reason["message"]
    assert 20 + out["meta_info"]["completion_tokens"] <= 32
