"""NGRAM's chain match in one Triton kernel (kernels/ngram_match.py) against its torch twin (the
interpreter on CPU, compiled on a GPU): random contexts over a few tokens, so that matches,
ties and more occurrences than the candidates looked at are common, and histories long enough
to span several of the kernel's blocks."""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.ngram_match import match_chain_rows  # noqa: E402

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton on CPU tensors needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU (without the interpreter)")]),
]
PAD = 0


def _case(seed: int, width: int, num_rows: int, bs: int, device: str):
    """A token buffer (one sink column past `width`, as TokenHistory keeps), rows in shuffled
    order, and context lengths from 1 (a padding row) to the whole width."""
    rnd = random.Random(seed)
    # A long history over many tokens: the last token is rare, and its occurrences lie blocks
    # apart.
    vocab = rnd.randint(2, 6) if width < 1000 else 400
    ids = torch.tensor([[rnd.randint(1, vocab) for _ in range(width + 1)]
                        for _ in range(num_rows)], dtype=torch.int32)
    rows = torch.tensor(rnd.sample(range(num_rows), bs))
    lens = torch.tensor([1, width] + [rnd.randint(1, width) for _ in range(bs - 2)])
    return ids.to(device), rows.to(device), lens.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_window,max_window,candidates,length",
                         [(1, 12, 64, 7), (2, 4, 64, 3), (1, 1, 64, 5), (1, 3, 2, 7),
                          (3, 12, 1, 4), (1, 5, 20, 1)])
def test_the_kernel_gives_the_twins_drafts(device, min_window, max_window, candidates, length):
    # Up to five of the kernel's 64-token blocks on the CPU; six of its 512 on a GPU.
    for seed, width in enumerate((40, 150, 300) if device == "cpu" else (40, 300, 3000)):
        ids, rows, lens = _case(seed * 7 + candidates, width, 12, 9, device)
        args = (ids, rows, width, lens, length, min_window, max_window, candidates, PAD)
        got = match_chain_rows(*args, use_triton=True)
        want = match_chain_rows(*args, use_triton=False)
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got, want), (seed, width)
        assert (got[0] == PAD).all()  # a context of one token has no earlier occurrence


@pytest.mark.parametrize("device", DEVICES)
def test_the_longest_match_wins_then_the_most_recent(device):
    """Context ... 1 2 3 9 | 2 3 8 | 1 2 3 [end]: the last token 3 occurs at positions 2, 5
    and 9 (9 is the last itself); position 2 matches 3 tokens (1 2 3), position 5 only 2, so
    the drafts follow position 2: 9 2 3 8. With max_window 2 both match 2 tokens and the most
    recent, position 5, wins: 8 1 2 3."""
    row = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    ids = torch.tensor([row + [0] * 7], dtype=torch.int32, device=device)
    rows, lens = torch.tensor([0], device=device), torch.tensor([len(row)], device=device)
    for window, want in ((4, [9, 2, 3, 8]), (2, [8, 1, 2, 3])):
        args = (ids, rows, 16, lens, 4, 1, window, 64, PAD)
        assert match_chain_rows(*args, use_triton=True).tolist() == [want]
        assert match_chain_rows(*args, use_triton=False).tolist() == [want]


def _paths(seed: int, rows, lens, width: int, nodes: int, device: str):
    """Each request's last verify: nodes (root first), accepted drafts m, bonus, and the prefix
    (the root's position), with the root already in the history. The engine keeps a context
    that long short of the history's width (SpecOverlap.usable), and so do these."""
    rnd = random.Random(seed)
    bs = rows.shape[0]
    tokens = torch.tensor([[rnd.randint(1, 5) for _ in range(nodes)] for _ in range(bs)])
    accept = torch.tensor([rnd.randint(0, nodes - 1) for _ in range(bs)])
    bonus = torch.tensor([rnd.randint(1, 5) for _ in range(bs)])
    prefix = (lens - 1).cpu().clamp(max=width - nodes - 1)
    return [t.to(device) for t in (tokens, accept, bonus, prefix)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_window,max_window,candidates,nodes",
                         [(1, 12, 64, 8), (2, 4, 64, 4), (1, 3, 2, 8), (1, 5, 20, 2)])
def test_the_append_and_match_kernel_gives_the_twins_history_and_proposal(
        device, min_window, max_window, candidates, nodes):
    """append_match_chain_rows: the path written into each row (up to the sink column), then
    the bonus and the drafts matched on the new context, as the twin's append and match."""
    from kernels.ngram_match import append_match_chain_rows

    for seed, width in enumerate((40, 150) if device == "cpu" else (40, 300, 3000)):
        ids, rows, lens = _case(seed * 5 + candidates, width, 12, 9, device)
        path = _paths(seed, rows, lens, width, nodes, device)
        args = (rows, width, *path, nodes - 1, min_window, max_window, candidates, PAD)
        ids_kernel, ids_twin = ids.clone(), ids.clone()
        got = append_match_chain_rows(ids_kernel, *args, use_triton=True)
        want = append_match_chain_rows(ids_twin, *args, use_triton=False)
        assert torch.equal(ids_kernel[:, :width], ids_twin[:, :width]), (seed, width)
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got, want), (seed, width)
        assert torch.equal(got[:, 0], path[2])  # the bonus is the next root


@pytest.mark.parametrize("device", DEVICES)
def test_an_appended_path_is_matched_at_once(device):
    """Row 1 2 3 9 2 | root 3 at position 5; the verify accepted 8 and 1, bonus 2: the row
    reads 1 2 3 9 2 3 8 1 2, whose last token 2 follows ... 1 at position 1 (1 2 matches two
    tokens), so the drafts are 3 9 2 3."""
    from kernels.ngram_match import append_match_chain_rows

    for use_triton in (True, False):
        ids = torch.tensor([[1, 2, 3, 9, 2, 3] + [0] * 11], dtype=torch.int32, device=device)
        nodes = torch.tensor([[3, 8, 1, 7, 7]], device=device)
        one = torch.tensor([0], device=device)
        out = append_match_chain_rows(ids, one, 16, nodes, one + 2, one + 2, one + 5, 4, 1, 4,
                                      64, PAD, use_triton=use_triton)
        assert ids[0, :9].tolist() == [1, 2, 3, 9, 2, 3, 8, 1, 2]
        assert out.tolist() == [[2, 3, 9, 2, 3]]
