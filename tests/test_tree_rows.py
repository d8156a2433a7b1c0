"""A draft tree's node rows (the attention plan of a tree step or verify): the Triton kernel
against its torch twin (the interpreter on CPU, a CUDA graph on the GPU), on the columns a node
reads (its prefix and the K tree keys) and its length."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.tree_rows import tree_path_rows, tree_path_rows_torch  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
POOL_ROWS, MAX_LEN = 9, 700


def _world(seq_lens: list, width: int, keys: int, seed: int, device="cpu", mask_dtype=torch.bool):
    """A pool of distinct slots, requests at shuffled pool rows, and a random tree mask in which
    every node sees itself (key e of the last E keys) and some of the keys before."""
    gen = torch.Generator().manual_seed(seed)
    r2t = torch.randperm(POOL_ROWS * MAX_LEN, generator=gen).view(POOL_ROWS, MAX_LEN).int()
    rows = torch.randperm(POOL_ROWS, generator=gen)[:len(seq_lens)].int()
    mask = torch.rand(len(seq_lens), width, keys, generator=gen) < 0.5
    mask[:, torch.arange(width), keys - width + torch.arange(width)] = True
    to = lambda t: t.to(device)  # noqa: E731
    return (to(r2t), to(rows), to(torch.tensor(seq_lens, dtype=torch.int32)),
            to(mask.to(mask_dtype)))


def _check(seq_lens, width, keys, seed, device="cpu", **kw):
    r2t, rows, lens_in, mask = _world(seq_lens, width, keys, seed, device, **kw)
    got, got_lens = tree_path_rows(r2t, rows, lens_in, mask, MAX_LEN, use_triton=True)
    want, want_lens = tree_path_rows_torch(r2t, rows, lens_in, mask, MAX_LEN)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got_lens.dtype == torch.int32 and torch.equal(got_lens, want_lens)
    for node, n in enumerate(seq_lens[i // width] for i in range(len(seq_lens) * width)):
        assert torch.equal(got[node, :n], want[node, :n]), node  # prefix + every tree key


@needs_interpreter
@pytest.mark.parametrize("width,keys", [(4, 4), (4, 12), (8, 8), (1, 1), (3, 17)])
def test_triton_matches_the_twin(width, keys):
    # Prefixes of 0, one block minus one, several blocks (BLOCK = 256) and a ragged one.
    _check([keys, 255 + keys, 600, 3 + keys], width, keys, seed=width * 100 + keys)


@needs_interpreter
def test_an_integer_mask_and_an_output_buffer():
    r2t, rows, lens_in, mask = _world([40, 90], 4, 8, seed=5, mask_dtype=torch.int32)
    buf = torch.full((16, MAX_LEN), -7, dtype=torch.int32)
    got, lens = tree_path_rows(r2t, rows, lens_in, mask, MAX_LEN, out=buf[:8], use_triton=True)
    want, want_lens = tree_path_rows_torch(r2t, rows, lens_in, mask != 0, MAX_LEN)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(lens, want_lens)
    assert torch.equal(got[:4, :40], want[:4, :40]) and torch.equal(got[4:, :90], want[4:, :90])
    assert (buf[8:] == -7).all()  # rows past the batch untouched
    for use_triton in (True, False):  # lengths into a buffer (what the attention plan reads)
        lens_buf = torch.full((10,), -3, dtype=torch.int32)
        _, lens = tree_path_rows(r2t, rows, lens_in, mask, MAX_LEN, lens_out=lens_buf[:8],
                                 use_triton=use_triton)
        assert lens.data_ptr() == lens_buf.data_ptr() and torch.equal(lens_buf[:8], want_lens)
        assert (lens_buf[8:] == -3).all()


def test_a_mask_of_the_wrong_rank_is_refused():
    r2t, rows, lens_in, mask = _world([10], 2, 4, seed=1)
    with pytest.raises(ValueError, match=r"tree_mask must be \[bs, E, K\]"):
        tree_path_rows(r2t, rows, lens_in, mask[0], MAX_LEN)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay():
    _check([8, 300, 650], 4, 8, seed=3, device="cuda")
    r2t, rows, lens_in, mask = _world([20, 400], 4, 12, seed=4, device="cuda")
    out = torch.empty(8, MAX_LEN, dtype=torch.int32, device="cuda")
    tree_path_rows(r2t, rows, lens_in, mask, MAX_LEN, out=out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lens = tree_path_rows(r2t, rows, lens_in, mask, MAX_LEN, out=out)
    _, _, new_lens, new_mask = _world([30, 500], 4, 12, seed=6, device="cuda")
    lens_in.copy_(new_lens)
    mask.copy_(new_mask)
    graph.replay()
    want, want_lens = tree_path_rows_torch(r2t, rows, lens_in, mask, MAX_LEN)
    assert torch.equal(lens, want_lens)
    assert torch.equal(out[:4, :30], want[:4, :30]) and torch.equal(out[4:, :500], want[4:, :500])
