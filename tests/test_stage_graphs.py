"""Pipeline stages' decode graphs on CPU (distributed/stage_graphs.py): a stage replays its own
layers per micro-batch, from static buffers padded to a bucket. Capture needs a GPU, so an eager
body stands in for the CUDA graph replay: it reads the same static buffers and writes the same
output tensors, so everything but the capture itself is checked (loading, padding, the live
micro-batch the attention sees, where padded tokens write their KV, the rule for when a graph
serves)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specpcg import Engine
from specpcg.core import ForwardMode
from specpcg.distributed.pipeline import make_stage_model
from specpcg.distributed.stage_graphs import StageGraphs
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.policy import GraphDecision, stage_graphs_serve_decode
from specpcg.kv_cache import SINK_SLOT
from specpcg.model_runner import ModelRunner
from specpcg.batch import make_batch

PROMPTS = [[5, 9, 2, 7], [11, 3, 8, 8, 1, 2, 3], [40, 41, 42]]


class _EagerReplay:
    """Stands in for a captured graph: replay reruns the body on the static buffers and copies
    its results into the tensors the capture returned, as a graph replay writes them."""

    def __init__(self, owner, n: int, out: tuple):
        self.owner, self.n, self.out = owner, n, out

    def replay(self) -> None:
        hidden, residual, aux = self.owner._body(self.n)
        for dst, src in zip((self.out[0], self.out[1], *self.out[2]), (hidden, residual, *aux)):
            dst.copy_(src)


class EagerStageGraphs(StageGraphs):
    def _warm(self, n: int) -> None:
        pass

    def _record(self, n: int) -> tuple:
        out = self._body(n)
        hidden, residual, aux = out
        out = (hidden.clone(), residual.clone(), [a.clone() for a in aux])
        return _EagerReplay(self, n, out), out


def _world(tiny_path, device: str):
    """A one-stage pipeline (all layers) over a plain engine's KV cache, three requests
    prefilled, and their decode step's batch."""
    engine = Engine(model_path=str(tiny_path), skip_tokenizer_init=True, device=device,
                    dtype="float32", max_total_tokens=256, show_progress=False,
                    disable_cuda_graph=True)
    kv, dev = engine.kv_cache, engine.device
    reqs = [SimpleNamespace(num_cached=0, req_pool_idx=kv.new_request()) for _ in PROMPTS]
    for r, p in zip(reqs, PROMPTS):
        kv.extend(r.req_pool_idx, len(p))
    out = engine.runner.forward(make_batch(kv, ForwardMode.EXTEND, reqs, PROMPTS, dev))
    nxt = out.logits.argmax(-1).tolist()
    for r, p in zip(reqs, PROMPTS):
        r.num_cached = len(p)
        kv.extend(r.req_pool_idx, 1)
    decode = make_batch(kv, ForwardMode.DECODE, reqs, [[t] for t in nxt], dev)
    stage, _ = make_stage_model(engine.model, engine.model_config, 0, 1)
    runner = ModelRunner(stage, kv, engine.attn_backend, dev)
    return SimpleNamespace(engine=engine, kv=kv, stage=stage, runner=runner, decode=decode)


@pytest.fixture
def world(tiny_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    w = _world(tiny_path, "cpu")
    yield w
    w.engine.shutdown()


def _run(world, group):
    """Stage 0's layers on micro-batch `group` of the decode batch, as the pipeline runs them."""
    batch, attn = world.decode, world.engine.attn_backend
    attn.init_forward_metadata(batch)
    with torch.inference_mode(), forward_context(ForwardContext(batch, attn, batch.num_tokens)):
        embedded = world.stage.model.embed_tokens(batch.input_ids)
        t0, t1 = group[2:]
        hidden, residual, _ = world.stage._run_group(batch, group, batch.positions,
                                                     embedded[t0:t1], None, (), [])
        return hidden.clone(), residual.clone()


def _kv_rows(world, slots: list) -> list:
    pool = world.kv.pool
    return [torch.stack([k[slots] for k in pool.k_buffers]),
            torch.stack([v[slots] for v in pool.v_buffers])]


def test_a_micro_batch_replays_its_bucket_and_gives_the_eager_layers(world):
    _check_replay(world, EagerStageGraphs(world.runner, [4, 8], (), None, show_progress=False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stage_graphs_replay_the_eager_layers(tiny_path):
    """The real capture: a stage's layers as breakable CUDA graphs, replayed per micro-batch."""
    w = _world(tiny_path, "cuda")
    try:
        pool = torch.cuda.graph_pool_handle()
        _check_replay(w, StageGraphs(w.runner, [4, 8], (), pool, show_progress=False))
    finally:
        w.engine.shutdown()


def _check_replay(world, graphs):
    decode = world.decode
    group = (1, 3, 1, 3)  # a later micro-batch: the last two requests, one token each
    live = decode.out_cache_loc[1:3].tolist()
    eager = _run(world, group)
    kv_eager = _kv_rows(world, live)
    for buf in world.kv.pool.k_buffers + world.kv.pool.v_buffers:
        buf[live] = 0  # the replay must write them again
    graphs.capture()
    assert sorted(graphs.graphs) == [4, 8]
    world.stage.body_graphs = graphs
    before = [k.clone() for k in world.kv.pool.k_buffers]
    replayed = _run(world, group)
    assert graphs.replays == 1
    for got, want in zip(replayed, eager):
        assert got.shape == want.shape == (2, 64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(_kv_rows(world, live), kv_eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The bucket's 2 padded tokens wrote no live request's KV: only the micro-batch's own
    # slots (and at most the sink slot) changed.
    for k, old in zip(world.kv.pool.k_buffers, before):
        changed = set((k != old).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed <= set(live) | {SINK_SLOT} and changed & set(live)


def test_a_graph_serves_decode_and_verify_micro_batches_only(world):
    graphs = EagerStageGraphs(world.runner, [4, 8], (), None, show_progress=False)
    decode = world.decode
    assert not graphs.serves(decode, 3, ())  # nothing captured yet
    graphs.capture()
    assert graphs.serves(decode, 3, ()) and graphs.serves(decode, 8, ())
    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_row_stride=0)
    assert graphs.serves(verify, 8, ())
    assert not graphs.serves(decode, 9, ())  # past the largest bucket: eager
    assert not graphs.serves(decode, 3, (1,))  # aux layers it did not capture
    prefill = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_row_stride=0)
    assert not graphs.serves(prefill, 3, ())  # a prefill replays the whole-forward graphs
    strided = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_row_stride=4)
    assert not graphs.serves(strided, 3, ())


def test_stage_graphs_are_on_under_pipeline_parallelism_wherever_piecewise_graphs_are():
    on, off = GraphDecision(True, "on"), GraphDecision(False, "off")
    assert stage_graphs_serve_decode(on, 2) and stage_graphs_serve_decode(on, 4)
    assert not stage_graphs_serve_decode(on, 1) and not stage_graphs_serve_decode(off, 2)
