"""The end of an overlapped speculative step: the Triton kernel against its torch twin (the
interpreter on CPU), for trees (tokens and KV slots into path order) and chains, with padding
rows among the requests."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.step_commit import StepOutputs, commit_step, path_first  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


def _world(bs: int, n: int, seed: int):
    """Accepted paths of distinct nodes (root first, -1 after), their lengths, a padding row,
    tokens, bonus, prefixes and distinct slots in a req_to_token."""
    gen = torch.Generator().manual_seed(seed)
    accept_index = torch.full((bs, n), -1, dtype=torch.int64)
    accept_len = torch.randint(0, n, (bs,), generator=gen)
    for i in range(bs):
        nodes = torch.randperm(n - 1, generator=gen)[:int(accept_len[i])] + 1
        accept_index[i, 0] = 0
        accept_index[i, 1:1 + len(nodes)] = nodes.sort().values  # a path's depths rise
    live = torch.ones(bs, dtype=torch.bool)
    live[-1] = False  # a padding row: its accept length counts as 0
    tokens = torch.randint(0, 1000, (bs, n), generator=gen)
    bonus = torch.randint(0, 1000, (bs,), generator=gen)
    prefix = torch.randint(0, 20, (bs,), generator=gen)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    r2t = torch.randperm((bs + 2) * 64, generator=gen).view(bs + 2, 64).int()
    return accept_index, accept_len, live, tokens, bonus, prefix, rows, r2t


def _outputs(bs: int, n: int) -> StepOutputs:
    z = lambda *shape: torch.full(shape, -9, dtype=torch.int64)  # noqa: E731
    return StepOutputs(z(bs, n), z(bs), z(bs), z(bs), z(bs, 2 + 2 * n))


@needs_interpreter
@pytest.mark.parametrize("bs,n,tree", [(3, 12, True), (2, 8, True), (4, 5, False), (1, 33, True)])
def test_triton_matches_the_twin(bs, n, tree):
    world = _world(bs, n, seed=bs * 100 + n)
    accept_index, accept_len, live, tokens, bonus, prefix, rows, r2t = world
    got_r2t, want_r2t = r2t.clone(), r2t.clone()
    got, want = _outputs(bs, n), _outputs(bs, n)
    got_order = commit_step(*world[:7], got_r2t, got, tree, use_triton=True)
    want_order = commit_step(*world[:7], want_r2t, want, tree, use_triton=False)
    assert torch.equal(got_order, want_order)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got_r2t, want_r2t)
    m = torch.where(live, accept_len, 0)
    assert torch.equal(got.accept_len, m) and torch.equal(got.prefix, prefix)
    if tree:  # the path's nodes first; the slots moved with them
        for i in range(bs):
            path = accept_index[i, :int(m[i]) + 1]
            assert torch.equal(got_order[i, :len(path)], path)
            cols = prefix[i] + torch.arange(n)
            assert torch.equal(got_r2t[rows[i], cols], r2t[rows[i], cols][got_order[i]])
            assert torch.equal(got.tokens[i], tokens[i][got_order[i]])
    else:
        assert torch.equal(got_order, torch.arange(n).expand(bs, n)) and torch.equal(got_r2t, r2t)


def test_path_first_puts_the_path_first_then_the_rest_ascending():
    accept_index = torch.tensor([[0, 3, 5, -1, -1, -1]])
    assert path_first(accept_index, torch.tensor([2])).tolist() == [[0, 3, 5, 1, 2, 4]]
