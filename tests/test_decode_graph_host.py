"""The decode graph runner's host side on CPU. Its graphs are stood in for by a replay that runs
the captured body again over the same buffers (what a CUDA graph replays is that body's work on
those addresses), so the static inputs, the one-copy load of a decode batch, the padding and
the req_to_token entries a DECODE graph writes itself (`rows_pending`) are checked token for
token against an engine without graphs. (On a GPU, tests/test_cuda_graphs.py replays real
graphs.)"""

import importlib.util
import os

import pytest
import torch

import specpcg.graphs.decode_runner as decode_runner
from specpcg.core import CaptureHiddenMode, ForwardMode, Request, SamplingParams
from specpcg.forward_context import forward_context, get_forward_context
from specpcg.kv_cache import KVCache
from specpcg.batch import make_batch
from tests.tiny_models import tiny_engine

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and the interpreter (TRITON_INTERPRET=1)")

PARAMS = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4 + [3], [20, 21] * 5]


def _flat(out):
    if out is None:  # a graph's output it does not take (a verify's greedy picks)
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for part in out for t in _flat(part)]


class _Replay:
    """A graph stand-in: replay() runs the body again and leaves its results where the capture
    left them, as a graph's outputs stay at fixed addresses."""

    def __init__(self, body, out):
        self.body, self.out = body, out
        self.context = get_forward_context()  # the capture's, as a graph keeps its kernels'
        self.replays = 0

    replaying = False  # a real replay runs no Python: writes made inside are the graph's

    def replay(self):
        self.replays += 1
        _Replay.replaying = True
        try:
            with forward_context(self.context):
                fresh = self.body()
        finally:
            _Replay.replaying = False
        for kept, new in zip(_flat(self.out), _flat(fresh)):
            kept.copy_(new)


def _fake_capture(body, pool):
    out = body()
    return _Replay(body, out), out


def _graph_engine(path, monkeypatch, write_rows: bool, plans_from_rows: bool = False,
                  greedy_in_graph: bool = True):
    from specpcg.attention.triton_backend import TritonAttnBackend

    monkeypatch.setenv("SPECPCG_GREEDY_IN_GRAPH", "1" if greedy_in_graph else "0")
    monkeypatch.setattr(TritonAttnBackend, "plans_from_rows", plans_from_rows)
    monkeypatch.setattr(decode_runner, "warm_and_capture", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the capture's timing
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    engine = tiny_engine(path, attention_backend="triton")
    runner = decode_runner.DecodeGraphRunner(engine.runner, [1, 2, 4], CaptureHiddenMode.NULL,
                                             (), None, show_progress=False,
                                             write_rows=write_rows)
    runner.capture()
    engine.router.runners["decode_graph"] = runner
    return engine, runner


def _written_rows(monkeypatch) -> list:
    """Counts the decode steps whose req_to_token entries the host writes from the batch
    (outside a graph's replay; a prefill's are always written so, before its forward)."""
    calls = []
    real = KVCache.write_rows

    def counted(self, batch):
        if not _Replay.replaying and batch.forward_mode == ForwardMode.DECODE:
            calls.append(batch.batch_size)
        return real(self, batch)

    monkeypatch.setattr(KVCache, "write_rows", counted)
    return calls


def _sampler_picks(monkeypatch) -> list:
    """Counts the greedy picks the sampler takes itself (the batch sizes)."""
    import specpcg.sampler as sampler

    calls, real = [], sampler.argmax_rows
    monkeypatch.setattr(sampler, "argmax_rows", lambda x: calls.append(x.shape[0]) or real(x))
    return calls


@pytest.mark.parametrize("write_rows, plans_from_rows, in_graph", [
    (True, False, True), (False, False, True), (True, True, True), (True, False, False)])
def test_decode_graphs_emit_the_eager_engines_tokens(tiny_path, monkeypatch, write_rows,
                                                      plans_from_rows, in_graph):
    """A backend that reads req_to_token while planning (plans_from_rows) gets the rows
    written by the router even where the runner was asked to write them. A step a graph
    served takes the greedy picks the graph made (in_graph) instead of the sampler's."""
    want = [o["output_ids"] for o in tiny_engine(tiny_path).generate(
        input_ids=PROMPTS, sampling_params=PARAMS)]
    engine, runner = _graph_engine(tiny_path, monkeypatch, write_rows, plans_from_rows,
                                   in_graph)
    assert runner.write_rows == (write_rows and not plans_from_rows)
    assert runner.greedy_in_graph == in_graph
    write_rows = runner.write_rows
    host_writes = _written_rows(monkeypatch)
    picks = _sampler_picks(monkeypatch)
    # Three requests pad to bucket 4; the last one alone runs at bucket 1.
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    single = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS)
    assert [o["output_ids"] for o in outs] == want
    assert single["output_ids"] == want[0]
    replays = {key[2]: g.replays for key, g in runner.graphs.items()}
    assert replays[4] > 0 and replays[1] > 0
    served = sum(s["count"] for s in engine.router.forward_stats()
                 if s["mode"] == "DECODE" and s["runner"] == "decode_graph")
    assert served == sum(replays.values())
    # The graph writes each step's entries itself, or the router writes them before it.
    assert (host_writes == []) if write_rows else (len(host_writes) == served)
    # Each generate's first token comes from its prefill, picked by the sampler.
    assert len(picks) == (2 if in_graph else 2 + served)
    assert engine.kv_cache.free_slots == engine.kv_cache.total_slots  # nothing leaked


def _cached_requests(kv_cache, prompts: list) -> list:
    """Requests whose prompts hold KV slots (num_cached past them), ready for new tokens."""
    reqs = []
    for ids in prompts:
        r = Request(prompt_ids=ids, params=SamplingParams())
        r.req_pool_idx = kv_cache.new_request()
        kv_cache.extend(r.req_pool_idx, len(ids))
        r.num_cached = len(ids)
        reqs.append(r)
    return reqs


def test_a_decode_batch_loads_in_one_block_unless_its_views_moved(tiny_path, monkeypatch):
    engine, runner = _graph_engine(tiny_path, monkeypatch, True)
    reqs = _cached_requests(engine.kv_cache, PROMPTS)
    engine.kv_cache.extend_many([r.req_pool_idx for r in reqs], [1] * len(reqs))
    batch = make_batch(engine.kv_cache, ForwardMode.DECODE, reqs, [[1], [2], [3]],
                       engine.device)
    assert runner._loads_block(batch, 1)
    padded = runner._padded_batch(batch, 4)
    assert padded.input_ids.tolist() == [1, 2, 3, 0]
    assert padded.req_pool_indices.tolist()[:3] == [r.req_pool_idx for r in reqs]
    assert padded.req_pool_indices[3].item() == engine.kv_cache.req_pool.pad_row
    assert padded.out_cache_loc[3].item() == 0 and padded.positions.tolist() == [
        len(p) for p in PROMPTS] + [0]
    batch.positions = batch.positions.clone()  # no longer the packed block's
    assert not runner._loads_block(batch, 1)
    assert runner._padded_batch(batch, 4).positions.tolist() == padded.positions.tolist()


def test_a_decode_batch_at_a_captured_size_is_one_copy(tiny_path, monkeypatch):
    """Its ids, positions, slots, request rows and seq lens come in the block's one copy (the
    graph copies its seq lens from the block's row itself: each copy the host queues costs it
    12-16 us on an H200); a batch whose seq lens moved copies them on their own."""
    engine, runner = _graph_engine(tiny_path, monkeypatch, True)
    reqs = _cached_requests(engine.kv_cache, PROMPTS[:2])
    engine.kv_cache.extend_many([r.req_pool_idx for r in reqs], [1, 1])
    batch = make_batch(engine.kv_cache, ForwardMode.DECODE, reqs, [[1], [2]], engine.device)
    copies, real = [], torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (
        copies.append(tuple(src.shape)), real(self, src, *a, **k))[1])
    runner._padded_batch(batch, 2)
    assert copies == [(5, 2)]
    assert runner._rows[4, :2].tolist() == [len(p) + 1 for p in PROMPTS[:2]]
    copies.clear()
    batch.seq_lens = batch.seq_lens.clone()  # no longer the block's
    runner._padded_batch(batch, 2)
    assert copies == [(2,)] * 5  # request rows, ids, positions, slots, then seq lens
    assert runner._rows[4, :2].tolist() == [len(p) + 1 for p in PROMPTS[:2]]


def test_pending_rows_are_written_from_the_batch_for_any_widths():
    """extend_many(write=False) leaves req_to_token as it was; write_rows then puts each new
    token's slot at its position, for requests of different widths, as extend_many would."""
    from specpcg.kv_cache import KVPool, ReqToTokenPool

    def cache():
        pool = KVPool(256, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                      device="cpu")
        return KVCache(pool, ReqToTokenPool(4, 64, "cpu"))

    written, pending = cache(), cache()
    counts = [3, 1, 2]
    for kv in (written, pending):
        reqs = _cached_requests(kv, [[1] * 5] * len(counts))
        kv.extend_many([r.req_pool_idx for r in reqs], counts, write=kv is written)
        batch = make_batch(kv, ForwardMode.EXTEND, reqs, [[7] * n for n in counts], "cpu",
                           rows_pending=kv is pending)
    before = pending.req_pool.req_to_token.clone()
    assert batch.rows_pending and batch.index_rows is None  # widths differ: no block
    assert not torch.equal(before, written.req_pool.req_to_token)
    pending.write_rows(batch)
    assert not batch.rows_pending
    assert torch.equal(pending.req_pool.req_to_token, written.req_pool.req_to_token)
