"""Continuous batching, chunked prefill, preemption and slot accounting on a tiny model (CPU)."""

import pytest
import torch

from tests.tiny_models import tiny_engine

GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}


def _engine(path, **kw):
    return tiny_engine(path, **{"max_total_tokens": 2048, **kw})


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(1, 60, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


def test_batch_equals_alone(tiny_path):
    engine = _engine(tiny_path)
    prompts = _prompts(8)
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    batched = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batched] == alone
    assert all(len(a) == 20 for a in alone)


def test_chunked_prefill_and_preemption_keep_tokens(tiny_path):
    prompts = _prompts(8, seed=1)
    ref = _engine(tiny_path).generate(input_ids=prompts, sampling_params=GREEDY)
    # 16-token prefill budget chunks every long prompt; 200 slots force preemption in decode.
    tight = _engine(tiny_path, chunked_prefill_size=16, max_total_tokens=200)
    out = tight.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    assert tight.get_server_info()["num_preemptions"] > 0
    kv = tight.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]


def test_max_running_requests_caps_batch(tiny_path):
    engine = _engine(tiny_path, max_running_requests=3)
    prompts = _prompts(7, seed=2)
    ref = _engine(tiny_path).generate(input_ids=prompts, sampling_params=GREEDY)
    seen = []
    step = engine.scheduler.step

    def spy():
        seen.append(len(engine.scheduler.running))
        return step()

    engine.scheduler.step = spy
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert max(seen) <= 3
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]


def test_min_prefill_requests_batches_admissions(tiny_path):
    """New requests wait until 4 slots are free (or all that wait fit), and tokens do not change."""
    prompts = _prompts(11, seed=3)
    params = [{**GREEDY, "max_new_tokens": 3 + 2 * i} for i in range(11)]  # staggered finishes
    ref = _engine(tiny_path).generate(input_ids=prompts, sampling_params=params)
    engine = _engine(tiny_path, max_running_requests=6, min_prefill_requests=4)
    sched, admitted = engine.scheduler, []
    run = sched._run_prefill

    def spy(picked):
        admitted.append((len(sched.running), sum(r.num_cached == 0 for r, _ in picked)))
        return run(picked)

    sched._run_prefill = spy
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    later = [new for running, new in admitted if running > 0]  # admitted while a batch decodes
    assert sum(later) == 11 - 6 and all(new >= 4 for new in later[:-1]), admitted
    with pytest.raises(ValueError, match="min_prefill_requests"):
        _engine(tiny_path, min_prefill_requests=0)


def test_hundred_requests_leave_no_slot(tiny_path):
    engine = _engine(tiny_path, max_total_tokens=1024)
    total = engine.get_server_info()["kv_cache"]["total_slots"]
    params = [{"max_new_tokens": 1 + i % 9, "temperature": 0.7 * (i % 2), "seed": i,
               "ignore_eos": True}
              for i in range(100)]
    outs = engine.generate(input_ids=_prompts(100, seed=3), sampling_params=params)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1 + i % 9 for i in range(100)]
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"] == total


def test_stop_token_ids_and_meta_info(tiny_path):
    engine = _engine(tiny_path)
    free = engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    stop_at = free["output_ids"][4]
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    first = free["output_ids"].index(stop_at)
    assert out["output_ids"] == free["output_ids"][:first + 1]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == first + 1
    assert 0 < meta["ttft"] <= meta["e2e_latency"]
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 20}


def test_context_length_ends_generation(tiny_path):
    engine = _engine(tiny_path, context_length=32)
    out = engine.generate(input_ids=list(range(1, 21)), sampling_params=GREEDY)
    assert out["meta_info"]["completion_tokens"] == 12
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_path):
    engine = _engine(tiny_path)
    p = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7,
         "ignore_eos": True}
    a = engine.generate(input_ids=[5, 6, 7], sampling_params=p)["output_ids"]
    batch = engine.generate(input_ids=[[9, 9], [5, 6, 7]], sampling_params=[{**p, "seed": 1}, p])
    assert batch[1]["output_ids"] == a
    other = engine.generate(input_ids=[5, 6, 7], sampling_params={**p, "seed": 8})["output_ids"]
    assert other != a


def test_request_slices_read_prompt_and_output_as_one_sequence():
    from specpcg.core import Request, SamplingParams

    req = Request(prompt_ids=[1, 2, 3], params=SamplingParams())
    assert req.last_id == 3 and req.ids_slice(1) == [2, 3] and req.ids_slice(0, 9) == [1, 2, 3]
    req.output_ids += [4, 5]
    whole = req.all_ids
    for start in range(6):
        for stop in (None, *range(start, 8)):
            assert req.ids_slice(start, stop) == whole[start:stop], (start, stop)
    assert req.last_id == 5


def test_deterministic_mode_reserves_outputs_instead_of_preempting(tiny_path):
    """enable_deterministic_inference admits a request only while the KV cache holds every
    admitted request's whole output: a preempted request is re-prefilled through the extend
    kernel, whose reduction order differs from decode's, which in bf16 could change its later
    tokens. The same tight cache preempts in the default mode."""
    prompts = _prompts(8, seed=1)
    ref = _engine(tiny_path).generate(input_ids=prompts, sampling_params=GREEDY)
    kw = dict(chunked_prefill_size=16, max_total_tokens=200)
    default = _engine(tiny_path, **kw)
    default.generate(input_ids=prompts, sampling_params=GREEDY)
    assert default.get_server_info()["num_preemptions"] > 0
    det = _engine(tiny_path, enable_deterministic_inference=True, **kw)
    out = det.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    info = det.get_server_info()
    assert info["num_preemptions"] == 0
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]


@pytest.mark.parametrize("starts,counts", [([5, 0, 9], [1, 1, 1]), ([3, 0, 7], [4, 0, 30]),
                                           ([100, 2], [600, 513])])
def test_runs_are_each_request_consecutive_ints_whichever_path_builds_them(starts, counts):
    """Decode-sized batches take the list path, long prefills the numpy one: same values."""
    from specpcg.transfer import runs

    got = runs(starts, counts)
    assert str(got.dtype) == "int64"
    assert got.tolist() == [p for s, n in zip(starts, counts) for p in range(s, s + n)]


def test_a_prefill_leaves_its_req_to_token_rows_to_its_forward(tiny_path):
    """No prefill chunk's slots go to req_to_token from the host (one numpy pass and one copy
    fewer before a prompt's first token): its forward writes them from the batch, and after it
    each request's row holds the slots the host gave it."""
    from specpcg.core import ForwardMode

    engine = _engine(tiny_path, chunked_prefill_size=16)
    kv, sched = engine.scheduler.kv_cache, engine.scheduler
    writes, checked = [], []
    extend, forward = kv.extend_many, sched.runner.forward

    def spy_extend(idxs, counts, write=True):
        writes.append(write)
        return extend(idxs, counts, write=write)

    def spy_forward(batch, *args, **kw):
        out = forward(batch, *args, **kw)
        if batch.forward_mode == ForwardMode.EXTEND:
            for idx, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu):
                row = kv.req_pool.req_to_token[idx, :n].tolist()
                checked.append(row == kv.slots_of(idx)[:n])
        return out

    kv.extend_many, sched.runner.forward = spy_extend, spy_forward
    prompts = _prompts(4, seed=3)
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    ref = _engine(tiny_path).generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    assert writes and not any(writes)
    assert len(checked) > len(prompts) and all(checked)  # chunks of 16: more than one a prompt
