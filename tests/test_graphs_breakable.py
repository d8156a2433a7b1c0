"""Breakable CUDA graphs and capture buckets. CPU tests check the capture bookkeeping with a fake
CUDAGraph that logs calls; `cuda` tests capture a toy model and check replay == eager, bitwise."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from specpcg.graphs import breakable
from specpcg.graphs.breakable import (BreakableGraph, breakable_capture, capture_stream,
                                      eager_break, is_capturing)
from specpcg.graphs.buckets import decode_batch_buckets, pick_bucket, piecewise_token_buckets


def cuda_test(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.cuda(skip(fn))


def test_piecewise_buckets_exact_list():
    assert piecewise_token_buckets(32) == [4, 8, 12, 16, 20, 24, 28, 32]
    assert piecewise_token_buckets(100) == [4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96]
    b = piecewise_token_buckets(8192)
    assert b[:10] == [4, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    assert b[-6:] == [5632, 6144, 6656, 7168, 7680, 8192]
    assert [1024, 1280, 1536] == b[b.index(1024):b.index(1024) + 3]
    assert b == sorted(set(b))
    assert piecewise_token_buckets(3) == [] and piecewise_token_buckets(4) == [4]
    assert piecewise_token_buckets(5000)[-3:] == [3840, 4096, 4608]  # only sizes <= max
    for bad in (0, -8, 2.5):
        with pytest.raises(ValueError, match="max_tokens"):
            piecewise_token_buckets(bad)


@pytest.mark.parametrize("max_tokens,count", [(2048, 42), (4096, 50), (8192, 58), (16384, 74)])
def test_piecewise_bucket_counts_match_sglang(max_tokens, count):
    buckets = piecewise_token_buckets(max_tokens)
    assert len(buckets) == count and buckets[-1] == max_tokens


def test_decode_batch_buckets():
    assert decode_batch_buckets(1) == [1]
    assert decode_batch_buckets(3) == [1, 2, 3]
    assert decode_batch_buckets(8) == [1, 2, 4, 8]
    assert decode_batch_buckets(9) == [1, 2, 4, 8, 9]
    assert decode_batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_bs"):
        decode_batch_buckets(0)


def test_pick_bucket_edges():
    buckets = [4, 8, 16]
    assert [pick_bucket(buckets, n) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert pick_bucket(buckets, 17) is None and pick_bucket([], 1) is None
    with pytest.raises(ValueError):
        pick_bucket(buckets, 0)


def test_eager_break_is_passthrough_outside_capture():
    calls = []

    @eager_break
    def double(x):
        """doc"""
        calls.append(is_capturing())
        return x * 2

    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == [False] and double.__name__ == "double" and double.__doc__ == "doc"
    from specpcg.models import llama  # the attention kernel is the model's break point
    assert llama._attend.__wrapped__.__name__ == "_attend"


class _FakeSegment:
    """Stands in for torch.cuda.CUDAGraph: logs begin/end/replay instead of recording."""
    log: list = []

    def capture_begin(self, pool=None):
        self._pool = pool if pool is not None else ("private", id(self))
        self.log.append(("begin", pool))

    def capture_end(self):
        self.log.append("end")

    def pool(self):
        return self._pool

    def replay(self):
        self.log.append("replay")


@pytest.fixture
def fake_cuda(monkeypatch):
    _FakeSegment.log = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeSegment)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(breakable, "capture_stream", lambda: None)  # torch.cuda.stream(None): no-op
    return _FakeSegment.log


def test_capture_splits_at_breaks_and_replays_in_order(fake_cuda):
    @eager_break
    def note(tag, out):
        fake_cuda.append(tag)
        out.fill_(len(fake_cuda))  # new value each call: replay must copy it into `out`

    @eager_break
    def fresh(x):
        fake_cuda.append("fresh")
        return x + len(fake_cuda)

    buf, graph = torch.zeros(2), BreakableGraph()
    with breakable_capture(graph, pool="P") as g:
        assert g is graph and is_capturing()
        note("a", buf)
        y = fresh(buf)
    assert not is_capturing() and graph.captured
    assert fake_cuda == [("begin", "P"), "end", "a", ("begin", "P"), "end", "fresh",
                         ("begin", "P"), "end"]
    assert len(graph.segments) == 3 and graph.break_names[0].endswith("note")
    fake_cuda.clear()
    graph.replay()
    assert fake_cuda == ["replay", "a", "replay", "fresh", "replay"]
    assert torch.equal(buf, torch.full((2,), 2.0)) and torch.equal(y, torch.full((2,), 6.0))


def test_writes_out_replays_into_the_buffer_the_next_segment_reads(fake_cuda):
    """A writes_out break gets, at replay, the very tensor captured as its output (here the
    staging arena's), so it writes there: no allocation and no copy after it."""
    from specpcg.graphs.staging import StagingArena

    outs, factor = [], {"value": 2.0}  # ambient state: what changes between replays

    @eager_break(writes_out=True)
    def scaled(x, out=None):
        if out is None:
            out = torch.empty_like(x)
        outs.append(out)
        return torch.mul(x, factor["value"], out=out)

    x, graph = torch.ones(3), BreakableGraph()
    with breakable_capture(graph, pool="P", staging=StagingArena(4)):
        y = scaled(x)
    assert torch.equal(y, torch.full((3,), 2.0)) and outs[0] is not y  # staged at capture
    factor["value"] = 5.0
    copies = []
    orig_copy = torch.Tensor.copy_
    try:
        torch.Tensor.copy_ = lambda self, src, *a, **k: copies.append(1) or orig_copy(self, src)
        graph.replay()
    finally:
        torch.Tensor.copy_ = orig_copy
    assert outs[1] is y and torch.equal(y, torch.full((3,), 5.0)) and copies == []
    with pytest.raises(TypeError, match="must return one tensor"):
        with breakable_capture(BreakableGraph(), pool="P"):
            eager_break(writes_out=True)(lambda out=None: None)()


def test_a_per_call_break_keeps_each_result_until_the_graph_is_done(fake_cuda):
    """An all-reduce's result is the residual stream, read after the layer's next all-reduce:
    each call of a per_call break stages into buffers of its own, so the second call's result
    leaves the first's intact, at capture and at every replay (a shared staged output would
    hold the second result twice: the bug that gave wrong tokens under TP with piecewise
    graphs on GPUs)."""
    from specpcg.graphs.staging import StagingArena

    for per_call, first_kept in ((True, True), (False, False)):
        @eager_break(per_call=per_call)
        def doubled(x):
            return x * 2

        a, b, graph = torch.ones(3), torch.full((3,), 5.0), BreakableGraph()
        with breakable_capture(graph, pool="P", staging=StagingArena(4)):
            ra = doubled(a)
            rb = doubled(b)
        assert torch.equal(rb, torch.full((3,), 10.0))
        assert torch.equal(ra, torch.full((3,), 2.0)) == first_kept, per_call
        ra.fill_(0.0)
        graph.replay()  # the breaks run again on their staged arguments
        assert torch.equal(ra, torch.full((3,), 2.0 if first_kept else 10.0)), per_call
        assert (ra.data_ptr() != rb.data_ptr()) == first_kept


def test_break_inside_a_break_runs_plainly_and_private_pool_is_shared(fake_cuda):
    inner = eager_break(lambda x: x + 1)
    outer = eager_break(lambda x: inner(x) * 2)
    graph = BreakableGraph()
    with breakable_capture(graph, pool=None):
        assert torch.equal(outer(torch.ones(1)), torch.full((1,), 4.0))
    assert len(graph.breaks) == 1 and len(graph.segments) == 2
    assert fake_cuda == [("begin", None), "end", ("begin", graph.segments[0].pool()), "end"]


def test_nesting_is_refused(fake_cuda):
    with breakable_capture(BreakableGraph(), pool="P"):
        with pytest.raises(RuntimeError, match="nested"):
            with breakable_capture(BreakableGraph(), pool="P"):
                pass
    assert not is_capturing()


def test_exception_during_capture_cleans_up(fake_cuda):
    graph = BreakableGraph()
    with pytest.raises(ValueError, match="model bug"):
        with breakable_capture(graph, pool="P"):
            eager_break(lambda: None)()
            raise ValueError("model bug")
    assert fake_cuda[-1] == "end"  # the open segment's stream capture was ended
    assert not is_capturing() and graph.segments == [] and not graph.captured
    with pytest.raises(RuntimeError, match="nothing to replay"):
        graph.replay()
    with pytest.raises(TypeError, match="returned int"):  # frozen into the graph: refused
        with breakable_capture(BreakableGraph(), pool="P"):
            eager_break(lambda: 3)()
    assert not is_capturing()


def test_a_capture_takes_a_cublas_workspace_of_its_own(fake_cuda, monkeypatch):
    """torch's cached cuBLAS workspaces are dropped after the warm-up and before a capture
    begins, once a breakable capture (its later segments share the one the first allocates)."""
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: fake_cuda.append("clear"), raising=False)
    with breakable_capture(BreakableGraph(), pool="P"):
        eager_break(lambda x: x + 1)(torch.zeros(1))
    assert fake_cuda == ["clear", ("begin", "P"), "end", ("begin", "P"), "end"]

    @contextmanager
    def fake_graph(graph, pool=None, stream=None):
        fake_cuda.append(("capture", pool))
        yield

    fake_cuda.clear()
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(breakable, "joined_capture_stream", lambda: None)
    _, out = breakable.warm_and_capture(lambda: fake_cuda.append("run") or 7, pool="P")
    # then one replay: CUDA uploads a graph at its first launch, paid here at start-up
    assert fake_cuda == ["run", "run", "clear", ("capture", "P"), "run", "replay"] and out == 7
    fake_cuda.clear()
    monkeypatch.setattr(breakable, "REPLAY_ON_CAPTURE", False)  # probe_first_replay.py's
    breakable.warm_and_capture(lambda: fake_cuda.append("run"), pool="P")
    assert fake_cuda == ["run", "run", "clear", ("capture", "P"), "run"]


def test_replay_errors_name_the_step(fake_cuda):
    state = {"fail": False}

    @eager_break
    def flaky(x):
        if state["fail"]:
            raise ValueError("metadata missing")
        return x.clone()

    graph = BreakableGraph()
    with breakable_capture(graph, pool="P"):
        flaky(torch.ones(1))
        flaky(torch.ones(1))
    state["fail"] = True
    with pytest.raises(RuntimeError, match=r"break 0 \(.*flaky\)") as err:
        graph.replay()
    assert isinstance(err.value.__cause__, ValueError)
    state["fail"] = False
    graph.segments[2].replay = lambda: (_ for _ in ()).throw(RuntimeError("bad graph"))
    with pytest.raises(RuntimeError, match="segment 2 of 3 segments: bad graph"):
        graph.replay()
    sizes = [4]
    graph = BreakableGraph()
    with breakable_capture(graph, pool="P"):
        eager_break(lambda: torch.zeros(sizes[0]))()
    sizes[0] = 5
    with pytest.raises(RuntimeError, match="break 0 .*keep its element count"):
        graph.replay()
    # A reshaped output with the same element count is fine (checked by count, not shape).
    shapes = [(4, 6)]
    graph = BreakableGraph()
    with breakable_capture(graph, pool="P"):
        captured = eager_break(lambda: torch.arange(24.0).reshape(shapes[0]))()
    shapes[0] = (4, 2, 3)
    graph.replay()
    assert captured.shape == (4, 6) and torch.equal(captured.flatten(), torch.arange(24.0))


@eager_break
def _keep_rows(h: torch.Tensor, meta: torch.Tensor, toy) -> torch.Tensor:
    """Zeroes rows past meta[0]: `.item()` syncs the host, which a stream capture forbids."""
    toy.break_calls += 1
    if toy.fail:
        raise ValueError("metadata missing")
    keep = int(meta[0].item())
    out = torch.zeros_like(h)
    out[:keep] = h[:keep]
    return out


@eager_break
def _scale_into(h: torch.Tensor, meta: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(h, float(meta[1].item()), out=out)  # writes into a buffer allocated in a segment


@eager_break
def _add_one(buf: torch.Tensor) -> None:
    buf.add_(1.0)  # right after another break: the segment between them is empty


class _Toy(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.lin1, self.lin2, self.lin3 = (nn.Linear(hidden, hidden) for _ in range(3))
        self.meta = torch.tensor([3, 2], dtype=torch.int32)  # [keep_len, scale]
        self.break_calls, self.fail = 0, False

    @torch.inference_mode()  # as ModelRunner.forward: outputs are inference tensors
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin2(_keep_rows(self.lin1(x), self.meta, self))
        buf = torch.empty_like(h)  # [T, hidden]
        _scale_into(h, self.meta, buf)
        _add_one(buf)
        return self.lin3(buf)


def _captured_toy(buckets=(8, 16)):
    torch.manual_seed(0)
    toy = _Toy().cuda()
    toy.meta = toy.meta.cuda()
    x_static = torch.randn(max(buckets), 64, device="cuda")  # [max_tokens, hidden]
    torch.cuda.synchronize()  # the side stream does not wait for the default one by itself
    with torch.cuda.stream(capture_stream()):
        toy(x_static)  # warm-up: cuBLAS handles and workspaces exist before capture
    pool, graphs = torch.cuda.graph_pool_handle(), {}
    for n in sorted(buckets, reverse=True):  # largest first: smaller buckets reuse its blocks
        graph = BreakableGraph()
        with breakable_capture(graph, pool):
            graphs[n] = (graph, toy(x_static[:n]))
    return toy, x_static, graphs


@cuda_test
def test_cuda_replay_equals_eager_bitwise_across_buckets():
    toy, x_static, graphs = _captured_toy()
    assert all(len(g.segments) == 4 and len(g.breaks) == 3 for g, _ in graphs.values())
    for keep, scale in ((5, 3), (2, -1)):
        toy.meta.copy_(torch.tensor([keep, scale]))
        x_static.copy_(torch.randn_like(x_static))
        for n, (graph, out) in graphs.items():
            calls = toy.break_calls
            graph.replay()
            assert toy.break_calls == calls + 1  # the break ran eagerly on replay
            expected = toy(x_static[:n])  # eager, same inputs and metadata
            assert torch.equal(out, expected), f"bucket {n}, keep {keep}"
    # The new metadata is seen: rows past `keep` no longer depend on the input.
    graph, out = graphs[16]
    before = out.clone()
    x_static.add_(1.0)
    graph.replay()
    assert torch.equal(out[2:], before[2:]) and not torch.equal(out[:2], before[:2])


@cuda_test
def test_cuda_break_error_during_replay_names_index():
    toy, x_static, graphs = _captured_toy(buckets=(8,))
    graph, out = graphs[8]
    toy.fail = True
    with pytest.raises(RuntimeError, match=r"break 0 \(_keep_rows\)") as err:
        graph.replay()
    assert isinstance(err.value.__cause__, ValueError)
    toy.fail = False
    graph.replay()  # a failed replay leaves nothing broken behind
    assert torch.equal(out, toy(x_static[:8]))


@cuda_test
def test_cuda_nesting_and_failed_capture_leave_no_capture_behind():
    toy, x_static, _ = _captured_toy(buckets=(8,))
    pool, graph = torch.cuda.graph_pool_handle(), BreakableGraph()
    with pytest.raises(RuntimeError, match="nested"):
        with breakable_capture(graph, pool):
            toy(x_static[:8])
            with breakable_capture(BreakableGraph(), pool):
                pass
    assert not is_capturing() and not torch.cuda.is_current_stream_capturing()
    assert graph.segments == []
    toy.fail = True
    with pytest.raises(ValueError, match="metadata missing"):
        with breakable_capture(BreakableGraph(), torch.cuda.graph_pool_handle()):
            toy(x_static[:8])
    toy.fail = False
    graph = BreakableGraph()  # torch refuses a pool whose only graphs were dropped: a new one
    with breakable_capture(graph, torch.cuda.graph_pool_handle()):
        out = toy(x_static[:8])
    graph.replay()
    assert torch.equal(out, toy(x_static[:8]))
