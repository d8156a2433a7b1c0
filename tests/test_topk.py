"""Row-wise top-k for draft trees: the Triton kernel against its torch twin (the interpreter on
CPU, bf16 and a CUDA graph on the GPU), its tie rule, and its refusals."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.topk import argmax_rows, topk_rows, topk_rows_torch  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
# One chunk, a chunk and a last chunk shorter than k, a chunk and a bit, a draft vocabulary
# and the default model's (24 chunks).
VOCABS = [16, 1000, 2048 + 3, 2048 + 37, 16384, 49152]


def _check(x, k, log_softmax):
    idx, val = topk_rows(x, k, log_softmax, use_triton=True)
    ref_idx, ref_val = topk_rows_torch(x, k, log_softmax)
    assert idx.dtype == torch.int64 and val.dtype == torch.float32
    assert idx.shape == ref_idx.shape == (*x.shape[:-1], k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(val, ref_val, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("log_softmax", [True, False])
def test_triton_matches_the_twin(vocab, k, log_softmax):
    gen = torch.Generator().manual_seed(vocab * 10 + k)
    x = torch.randn(3, 2, vocab, generator=gen) * 4  # [bs, branches, V], as a tree step's
    _check(x, min(k, vocab), log_softmax)


@needs_interpreter
def test_ties_come_lowest_index_first_and_minus_inf_counts_as_a_value():
    """Equal values: the lower index first, also across chunks; -inf entries are ranked last
    but still returned when a row has fewer finite ones than k."""
    x = torch.full((2, 5000), -5.0)
    x[0, [4000, 10, 2100]] = 3.0  # a three-way tie across two chunks
    x[0, 7] = 4.0
    x[1] = float("-inf")
    x[1, [4999, 3]] = 1.0
    idx, val = topk_rows(x, 5, use_triton=True)
    assert idx[0].tolist() == [7, 10, 2100, 4000, 0]
    assert val[0].tolist() == [4.0, 3.0, 3.0, 3.0, -5.0]
    assert idx[1].tolist()[:2] == [3, 4999] and val[1, 2:].eq(float("-inf")).all()
    assert len(set(idx[1].tolist())) == 5  # no entry picked twice
    _, logp = topk_rows(x[:1], 2, log_softmax=True, use_triton=True)
    torch.testing.assert_close(logp, x[:1].log_softmax(-1).topk(2).values)


@needs_interpreter
@pytest.mark.parametrize("vocab", [1000, 2048 + 37])  # one chunk (no merge), two chunks
def test_an_index_map_returns_mapped_indices(vocab):
    """A draft vocabulary's logits come back as target ids: the map applied to the indices the
    unmapped call returns, with the same values; a wrong map is refused."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=gen) * 4
    index_map = torch.randperm(5 * vocab, generator=gen)[:vocab]  # ids in a larger vocabulary
    for use_triton in (True, False):
        idx, val = topk_rows(x, 4, True, use_triton=use_triton, index_map=index_map)
        plain_idx, plain_val = topk_rows(x, 4, True, use_triton=use_triton)
        assert torch.equal(idx, index_map[plain_idx]) and torch.equal(val, plain_val)
    with pytest.raises(ValueError, match="index_map must be"):
        topk_rows(x, 4, index_map=index_map[:-1])


@needs_interpreter
def test_argmax_rows_takes_the_lowest_index_of_a_tie_like_torch():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 2048 + 37, generator=gen) * 4).bfloat16()
    x[0, 0, [5, 2080]] = 40.0  # a tie across two chunks
    got = argmax_rows(x, use_triton=True)
    assert got.dtype == torch.int64 and got.shape == (2, 3)
    assert torch.equal(got, x.float().argmax(-1)) and got[0, 0] == 5
    assert torch.equal(argmax_rows(x, use_triton=False), got)


def test_k_outside_the_row_is_refused():
    x = torch.zeros(2, 8)
    for k in (0, 9):
        with pytest.raises(ValueError, match="k must be in"):
            topk_rows(x, k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [16, 16384, 49152])
def test_cuda_bf16_and_graph_replay(vocab):
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    x = (torch.randn(16, 4, vocab, device="cuda", generator=gen) * 4).bfloat16()
    x[..., 5] = 30.0  # a clear winner in every row
    # bf16 rows hold exact ties: compare with the twin on the values and on the rule's order.
    idx, val = topk_rows(x, 4, log_softmax=True)
    ref_idx, ref_val = topk_rows_torch(x, 4, log_softmax=True)
    torch.testing.assert_close(val, ref_val, rtol=1e-5, atol=1e-5)
    assert (idx[..., 0] == 5).all()
    picked = x.float().log_softmax(-1).gather(-1, idx)
    torch.testing.assert_close(picked, val, rtol=1e-5, atol=1e-5)
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    topk_rows(static, 4, log_softmax=True)  # compiled before capture
    with torch.cuda.graph(graph):
        out = topk_rows(static, 4, log_softmax=True)
    static.copy_(x.flip(-1))
    graph.replay()
    want_idx, want_val = topk_rows(x.flip(-1), 4, log_softmax=True)
    assert torch.equal(out[0], want_idx) and torch.equal(out[1], want_val)
