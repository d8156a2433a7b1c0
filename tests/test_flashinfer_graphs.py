"""The flashinfer backend's decode graphs, on CPU against a stand-in `flashinfer` module that
records what the backend asks of it: one graph-mode wrapper per captured batch size over fixed
buffers, planned before each replay; eager wrappers elsewhere; verifies and draft rounds kept
out of full graphs. (On a GPU with flashinfer, tests/test_attention.py replays a real one.)"""

import sys
import types

import pytest
import torch

from specpcg.core import ForwardMode
from test_attention import NUM_HEADS, NUM_KV_HEADS, _make_batch, _make_cache


class _Wrapper:
    def __init__(self, workspace, layout, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)
        self.plans, self.runs = [], 0

    def plan(self, *args, **kwargs):
        self.plans.append(args)

    def run(self, q, paged_kv):
        self.runs += 1
        return torch.zeros_like(q)


@pytest.fixture
def backend(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    fake.BatchPrefillWithPagedKVCacheWrapper = _Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr("specpcg.attention.flashinfer_backend.WORKSPACE_BYTES", 1024)
    from specpcg.attention.flashinfer_backend import FlashInferAttnBackend

    cache = _make_cache("cpu", torch.float32, 16)
    return FlashInferAttnBackend(cache, NUM_HEADS, NUM_KV_HEADS, 16, 0.25)


def _attend(backend, batch):
    q = torch.zeros(batch.num_tokens, NUM_HEADS * 16)
    return backend.attend(q, 0, batch)


def test_each_captured_batch_size_plans_a_graph_wrapper_over_fixed_buffers(backend):
    cache = backend.kv_cache
    batch = _make_batch(cache, [(4, 1), (9, 1), (30, 1)], ForwardMode.DECODE)
    backend.init_graph_metadata(batch)
    wrapper = backend._graph_decode[3]
    assert wrapper.graph
    indptr, indices, last_page = wrapper.buffers
    assert indptr.shape == (4,) and last_page.shape == (3,)
    assert indptr.data_ptr() == backend._indptr_buf.data_ptr()
    assert indices.data_ptr() == backend._indices_buf.data_ptr()
    planned_indptr, planned_indices = wrapper.plans[0][:2]
    assert planned_indptr.tolist() == [0, 5, 15, 46]
    assert planned_indices.shape == (46,)
    _attend(backend, batch)
    assert wrapper.runs == 1 and backend._decode.runs == 0

    backend.init_graph_metadata(batch)  # a replay plans the same wrapper again
    assert backend._graph_decode == {3: wrapper} and len(wrapper.plans) == 2
    backend.init_graph_metadata(_make_batch(cache, [(2, 1)], ForwardMode.DECODE))
    assert sorted(backend._graph_decode) == [1, 3]
    assert backend._graph_decode[1].buffers[0].shape == (2,)


def test_eager_batches_use_the_plain_wrappers(backend):
    batch = _make_batch(backend.kv_cache, [(4, 1), (9, 1)], ForwardMode.DECODE)
    backend.init_graph_metadata(batch)
    backend.init_forward_metadata(batch)  # after a graph batch: the eager wrapper again
    _attend(backend, batch)
    assert backend._decode.runs == 1 and backend._graph_decode[2].runs == 0
    extend = _make_batch(backend.kv_cache, [(3, 4)], ForwardMode.EXTEND)
    backend.init_forward_metadata(extend)
    _attend(backend, extend)
    assert backend._prefill.runs == 1


def test_a_verify_cannot_plan_a_graph(backend):
    batch = _make_batch(backend.kv_cache, [(6, 4)], ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match="plain decode steps only, got forward_mode=TARGET_VERIFY"):
        backend.init_graph_metadata(batch)


def test_verifies_and_draft_rounds_stay_out_of_full_graphs():
    from specpcg.config import EngineConfig
    from specpcg.engine import Engine
    from specpcg.graphs.policy import decide_decode_graph

    cfg = EngineConfig()
    assert decide_decode_graph(cfg, "cuda", "flashinfer", True).enabled
    off = decide_decode_graph(cfg, "cuda", "flashinfer", True, decode_only=True)
    assert not off.enabled and "plain decode steps only" in off.reason

    def needs(decode_only: bool) -> dict:
        attn = types.SimpleNamespace(supports_tree_graph=False, decode_graph_only=decode_only)
        draft = types.SimpleNamespace(needs_hidden=None, aux_layers=())
        spec = types.SimpleNamespace(is_chain=True, num_draft_tokens=4)
        fake = types.SimpleNamespace(spec=spec, attn_backend=attn, draft=draft)
        return Engine._graph_needs(fake)

    assert needs(False)["num_verify_tokens"] == 4
    assert needs(True)["num_verify_tokens"] == 0
