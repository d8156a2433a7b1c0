"""Robustness under load: requests arrive over time through `submit` while `step` runs, with
NGRAM speculation on and bad requests interleaved. Every bad one is refused naming its field
and value without disturbing the others; every good one finishes with the tokens a plain
(no speculation) engine gives it; no KV slot leaks; the engine keeps serving afterwards."""

import random
import re

import pytest

from tests.tiny_models import tiny_engine

CONTEXT_LEN = 256  # the tiny model's max_position_embeddings
NUM_GOOD = 500


def _engine(path, **kw):
    return tiny_engine(path, **{"max_total_tokens": 8192, **kw})


@pytest.fixture(scope="module")
def spec_engine(tiny_path):
    # A small KV cache and prefill budget so the load also chunks prompts and preempts
    # requests in the middle of speculation.
    return _engine(tiny_path, speculative_algorithm="NGRAM", max_total_tokens=1024,
                   chunked_prefill_size=256)


@pytest.fixture(scope="module")
def plain_engine(tiny_path):
    return _engine(tiny_path)


def _good_requests(rng: random.Random, n: int) -> list:
    """(input_ids, sampling_params): prompt lengths 1..200, max_new_tokens 1..12, greedy; half
    ignore EOS so some runs are long enough for drafts to be accepted."""
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(128) for _ in range(rng.randint(1, 200))]
        params = {"max_new_tokens": rng.randint(1, 12), "temperature": 0,
                  "ignore_eos": i % 2 == 0}
        reqs.append((prompt, params))
    return reqs


def _value_pattern(field: str, value) -> str:
    return rf"{field}.*got {re.escape(repr(value))}$"


# (input_ids, sampling_params, regex the ValueError must match: it names field and value)
BAD_REQUESTS = [
    ([], {}, r"prompt is empty \(0 tokens\)"),
    ([1] * 300, {}, rf"prompt has 300 tokens but context_length is {CONTEXT_LEN}"),
    ([1, 2], {"max_new_tokens": -1}, _value_pattern("max_new_tokens", -1)),
    ([1, 2], {"max_new_tokens": 2.5}, _value_pattern("max_new_tokens", 2.5)),
    ([1, 2], {"max_new_tokens": "8"}, _value_pattern("max_new_tokens", "8")),
    ([1, 2], {"temperature": -0.5}, _value_pattern("temperature", -0.5)),
    ([1, 2], {"top_p": 0}, _value_pattern("top_p", 0)),
    ([1, 2], {"top_p": 1.5}, _value_pattern("top_p", 1.5)),
    ([1, 2], {"top_k": 0}, _value_pattern("top_k", 0)),
    ([1, 2], {"temprature": 0}, r"unknown field.*'temprature'"),
]


def _queue_size(engine) -> int:
    return len(engine.scheduler.waiting) + len(engine.scheduler.running)


def _submit_bad(engine, input_ids, params, pattern) -> None:
    """A bad request raises and queues nothing; requests in flight are untouched."""
    before = _queue_size(engine)
    with pytest.raises(ValueError, match=pattern):
        engine.submit(input_ids=input_ids, sampling_params=params)
    assert _queue_size(engine) == before


def _arrivals(rng: random.Random, good: list) -> list:
    """Good requests (by index) with each bad kind interleaved five times, in random order."""
    events = [("good", i) for i in range(len(good))]
    events += [("bad", k) for k in range(len(BAD_REQUESTS)) for _ in range(5)]
    rng.shuffle(events)
    return events


def _serve_over_time(engine, good: list, rng: random.Random) -> dict:
    """Submits bursts of 0..6 arrivals between steps; returns {good index: output}."""
    events, rid_to_index, outputs, num_bad = _arrivals(rng, good), {}, {}, 0
    while events or engine.has_unfinished():
        for kind, i in [events.pop() for _ in range(min(rng.randint(0, 6), len(events)))]:
            if kind == "bad":
                _submit_bad(engine, *BAD_REQUESTS[i])
                num_bad += 1
            else:
                prompt, params = good[i]
                rid_to_index[engine.submit(input_ids=prompt, sampling_params=params)] = i
        for out in engine.step():
            index = rid_to_index[out["meta_info"]["id"]]
            assert index not in outputs, f"request {index} returned twice"
            outputs[index] = out
    assert num_bad >= 40
    return outputs


def test_submit_over_time_under_load(spec_engine, plain_engine):
    rng = random.Random(0)
    good = _good_requests(rng, NUM_GOOD)
    outputs = _serve_over_time(spec_engine, good, rng)
    assert sorted(outputs) == list(range(NUM_GOOD))  # every good request completed
    for i, (prompt, params) in enumerate(good):
        meta = outputs[i]["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        want_len = params["max_new_tokens"]
        assert 1 <= meta["completion_tokens"] <= want_len
        assert meta["completion_tokens"] == want_len or not params["ignore_eos"]
    # NOTE: greedy fp32 speculation is lossless: tokens must equal the plain engine's.
    batched = plain_engine.generate(input_ids=[p for p, _ in good],
                                    sampling_params=[s for _, s in good])
    assert [outputs[i]["output_ids"] for i in range(NUM_GOOD)] == [o["output_ids"] for o in batched]
    for i in range(0, NUM_GOOD, 100):  # a handful truly alone
        alone = plain_engine.generate(input_ids=good[i][0], sampling_params=good[i][1])
        assert outputs[i]["output_ids"] == alone["output_ids"]
    info = spec_engine.get_server_info()
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1  # drafts were accepted
    assert info["num_preemptions"] > 0  # the load did reach the preemption path
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    after = spec_engine.generate(input_ids=[p for p, _ in good[:3]],
                                 sampling_params=[s for _, s in good[:3]])
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in batched[:3]]


def test_submit_step_matches_generate(spec_engine):
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    prompt = [5, 9, 5, 9, 5, 9, 17, 3]
    want = spec_engine.generate(input_ids=prompt, sampling_params=params)
    rid = spec_engine.submit(input_ids=prompt, sampling_params=params)
    outs = []
    while spec_engine.has_unfinished():
        outs += spec_engine.step()
    assert [o["meta_info"]["id"] for o in outs] == [rid]
    assert outs[0]["output_ids"] == want["output_ids"]
    assert spec_engine.step() == [] and not spec_engine.has_unfinished()


def test_submitted_request_finishing_inside_generate_is_kept(spec_engine):
    short = {"max_new_tokens": 1, "temperature": 0}
    rid = spec_engine.submit(input_ids=[1, 2, 3], sampling_params=short)
    spec_engine.generate(input_ids=[4, 5, 6], sampling_params={**short, "max_new_tokens": 8})
    assert spec_engine.has_unfinished()  # finished during generate, not yet returned
    outs = spec_engine.step()
    assert [o["meta_info"]["id"] for o in outs] == [rid]
    assert not spec_engine.has_unfinished()


def test_submit_refuses_a_list(spec_engine):
    with pytest.raises(ValueError, match="submit takes one request, got a list of 2 inputs"):
        spec_engine.submit(input_ids=[[1, 2], [3, 4]])
    assert not spec_engine.has_unfinished()
