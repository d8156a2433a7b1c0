"""A tree step's bookkeeping (kernels/tree_step.py): the Triton kernel against its torch twin in
the interpreter on CPU and natively on CUDA (a graph replay), its tie rule, its refusals."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.tree_step import advance_tree  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


def _inputs(bs, steps, k, s, seed, device="cpu", ties=False):
    """Grids as expand_tree holds them before step s, the step's children and the branches'
    scores and ancestry (s * K fed nodes; step 1's is the identity, expanded as expand_tree's)."""
    gen = torch.Generator().manual_seed(seed)
    grids = (torch.randint(0, 50000, (bs, steps, k, k), generator=gen),
             torch.randn(bs, steps, k, k, generator=gen),
             torch.randint(0, k * k, (bs, steps, k), generator=gen))
    top_ids = torch.randint(0, 50000, (bs, k, k), generator=gen)
    top_logp = torch.log_softmax(torch.randn(bs, k, k, generator=gen), -1)
    scores = -torch.rand(bs, k, generator=gen) * 3
    if ties:  # every branch alike: every path score ties with three others
        top_logp, scores = top_logp[:, :1].expand(bs, k, k).contiguous(), scores[:, :1].expand(bs, k)
    if s == 1:
        ancestors = torch.eye(k, dtype=torch.bool).expand(bs, k, k)
    else:
        ancestors = torch.rand(bs, k, s * k, generator=gen) < 0.5
    to = lambda t: t.to(device)  # noqa: E731
    return [to(t) for t in grids], [to(t) for t in (top_ids, top_logp, scores, ancestors)]


def _both(bs, steps, k, s, seed, device="cpu", ties=False):
    results = []
    for use_triton in (True, False):
        grids, step = _inputs(bs, steps, k, s, seed, device, ties)
        results.append((grids, advance_tree(*grids, *step, s, use_triton=use_triton)))
    return results


def _assert_same(results):
    (grids, got), (want_grids, want) = results
    for a, b in zip(grids, want_grids):
        assert torch.equal(a, b)
    assert (got is None) == (want is None)
    if got is not None:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("k,steps,s", [(4, 5, 1), (4, 5, 2), (4, 5, 3), (4, 5, 4), (2, 3, 1),
                                       (3, 4, 2), (1, 6, 3), (8, 3, 1)])
def test_triton_matches_the_twin(k, steps, s):
    _assert_same(_both(3, steps, k, s, seed=k * 100 + steps * 10 + s))


@needs_interpreter
def test_ties_go_to_the_lowest_index():
    """Every branch alike: each of the K best scores ties K ways; the kernel takes the lowest
    flat index, i.e. the same child of branches 0, 1, 2, 3 (torch.topk, the twin's, promises
    no order among ties)."""
    grids, step = _inputs(2, 5, 4, 2, seed=7, ties=True)
    out = advance_tree(*grids, *step, 2, use_triton=True)
    best_child = step[1][:, 0].argmax(-1)  # [bs]: the best child of (every) branch
    assert out.parent.tolist() == [[0, 1, 2, 3]] * 2
    assert grids[2][:, 3].tolist() == [[4 * b + int(c) for b in range(4)] for c in best_child]


def test_a_step_outside_the_tree_is_refused():
    grids, step = _inputs(1, 3, 2, 1, seed=0)
    for s in (0, 3):
        with pytest.raises(ValueError, match="tree step s must be in"):
            advance_tree(*grids, *step, s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_twin_and_replays():
    for s in (1, 2, 4):
        _assert_same(_both(16, 5, 4, s, seed=s, device="cuda"))
    grids, step = _inputs(16, 5, 4, 2, seed=9, device="cuda")
    advance_tree(*grids, *step, 2)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = advance_tree(*grids, *step, 2)
    _, new_step = _inputs(16, 5, 4, 2, seed=10, device="cuda")
    for t, new in zip(step, new_step):
        t.copy_(new)
    graph.replay()
    want_grids, _ = _inputs(16, 5, 4, 2, seed=9, device="cuda")
    want = advance_tree(*want_grids, *new_step, 2, use_triton=False)
    for a, b in zip(out, want):
        assert torch.equal(a, b)
