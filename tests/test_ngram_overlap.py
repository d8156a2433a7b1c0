"""NGRAM's overlapped steps: drafts matched on the device (drafts/ngram_device.py) are the host
index's drafts, and an engine that overlaps NGRAM steps emits the synchronous loop's tokens
with the same acceptance."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

import drafts.ngram as ngram
from drafts.ngram import _chain, _RequestIndex, _trie_bfs
from drafts.ngram_device import TokenHistory, match_tree
from kernels.ngram_match import append_path, match_chain
from specpcg.speculative.overlap import SpecOverlap
from tests.eagle_world import _engine, same_as_sync, world  # noqa: F401 (fixture)

PAD = 0
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and the interpreter (TRITON_INTERPRET=1)")


def _host_chain(ids: list, n: int, min_window: int, max_window: int) -> list:
    index = _RequestIndex(min_window, max_window)
    index.extend(ids)
    tokens, _ = _chain(index.continuations(n - 1, 1), n)
    return [PAD if t is None else t for t in tokens]


@pytest.mark.parametrize("min_window,max_window,candidates", [(1, 12, 64), (2, 4, 64), (1, 1, 64),
                                                              (1, 3, 2), (3, 12, 1)])
def test_device_match_is_the_host_index(monkeypatch, min_window, max_window, candidates):
    """Random contexts over a few tokens (many matches, many ties), past-the-end garbage in the
    history: every request's drafts equal the host index's, the recency cut included."""
    monkeypatch.setattr(ngram, "MAX_CANDIDATES", candidates)
    rnd, width, n = random.Random(min_window * 100 + candidates), 80, 6
    for _ in range(6):
        vocab = rnd.randint(2, 6)
        seqs = [[rnd.randint(1, vocab) for _ in range(rnd.randint(1, width))] for _ in range(7)]
        seqs.append([5, 6, 7, 5, 6])  # a match running off the end of the context
        history = torch.tensor([s + [rnd.randint(1, vocab) for _ in range(width - len(s))]
                                for s in seqs])
        lens = torch.tensor([len(s) for s in seqs])
        got = match_chain(history, lens, n - 1, min_window, max_window, candidates, PAD)
        assert got.tolist() == [_host_chain(s, n, min_window, max_window) for s in seqs]
        assert got[-1].tolist() == [7, 5, 6, PAD, PAD] or min_window > 2


def _host_tree(ids: list, n: int, min_window: int, max_window: int, breadth: int) -> tuple:
    index = _RequestIndex(min_window, max_window)
    index.extend(ids)
    tokens, parents = _trie_bfs(index.continuations(n - 1, breadth), n)
    return [PAD if t is None else t for t in tokens], parents


@pytest.mark.parametrize("min_window,max_window,candidates,breadth,n",
                         [(1, 12, 64, 10, 8), (1, 3, 64, 4, 6), (2, 4, 8, 10, 12), (1, 1, 64, 3, 5),
                          (1, 12, 3, 10, 8)])
def test_device_tree_is_the_host_trie(monkeypatch, min_window, max_window, candidates, breadth, n):
    """NGRAM's trees: the device's continuations and trie (BFS order, parents, root padding)
    equal the host's on random contexts over a few tokens, where continuations share prefixes,
    repeat, and run off the end of the context."""
    monkeypatch.setattr(ngram, "MAX_CANDIDATES", candidates)
    rnd, width, branched = random.Random(breadth * 100 + candidates + n), 80, 0
    for _ in range(8):
        vocab = rnd.randint(2, 5)
        seqs = [[rnd.randint(1, vocab) for _ in range(rnd.randint(1, width))] for _ in range(7)]
        seqs.append([5, 6, 7, 5, 6, 8, 5, 6])  # two continuations, one cut by the end
        history = torch.tensor([s + [rnd.randint(1, vocab) for _ in range(width - len(s))]
                                for s in seqs])
        lens = torch.tensor([len(s) for s in seqs])
        tokens, parents = match_tree(history, lens, n, min_window, max_window, candidates,
                                     breadth, PAD)
        want = [_host_tree(s, n, min_window, max_window, breadth) for s in seqs]
        assert tokens.tolist() == [w[0] for w in want]
        assert parents.tolist() == [w[1] for w in want]
        branched += sum(len(set(p)) < len(p) for _, p in want)
    assert branched > 0  # some node has two children


def test_token_history_copies_only_what_the_device_lacks():
    class Req:
        def __init__(self, rid, row, ids):
            self.rid, self.req_pool_idx, self.all_ids = rid, row, ids

    h = TokenHistory(num_rows=3, width=10, device="cpu")
    a, b = Req("a", 0, [4, 5, 6]), Req("b", 2, [7])
    h.sync([a, b])
    assert h.ids[0, :3].tolist() == [4, 5, 6] and h.ids[2, 0] == 7
    h.ids[0, :3] = -1  # what is marked as there is not copied again
    a.all_ids = a.all_ids + [8, 9]
    h.mark(a, 3)
    h.sync([a])
    assert h.ids[0, :5].tolist() == [-1, -1, -1, 8, 9]
    a.req_pool_idx = 1  # re-admitted into another row: all of it again
    h.sync([a])
    assert h.ids[1, :5].tolist() == [4, 5, 6, 8, 9]
    # A path (accepted nodes 1..m, then the bonus) lands after the root's position; what
    # passes the width reaches only the sink.
    append_path(h.ids, torch.tensor([2, 1]), h.width, torch.tensor([[0, 1, 3], [0, 4, 5]]),
                torch.tensor([1, 2]), torch.tensor([2, 6]), torch.tensor([0, 8]))
    assert h.ids[2, :4].tolist() == [7, 1, 2, 0]
    assert h.ids[1, 9].item() == 4 and h.ids[1, :5].tolist() == [4, 5, 6, 8, 9]


def _cycle_prompts(world, lengths) -> list:
    """Walks of the target's permutation long enough to come round again: NGRAM finds the
    continuation in the prompt, and the noisy target sometimes leaves it."""
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for n in lengths:
        tok = int(world.subset[torch.randint(0, len(world.subset), (1,), generator=gen)])
        walk = []
        for _ in range(n):
            walk.append(tok)
            tok = int(world.pi[tok])
        prompts.append(walk)
    return prompts


def _ngram_run(world, prompts, **kw):
    engine = _engine(world.noisy, "NGRAM", None, attention_backend="triton",
                     speculative_num_steps=4, **kw)
    params = [{"max_new_tokens": 12 + 3 * i, "temperature": 0, "ignore_eos": True}
              for i in range(len(prompts))]
    return engine, engine.generate(input_ids=prompts, sampling_params=params)


TREE = {"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}


@needs_interpreter
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_overlapped_ngram_steps_emit_the_synchronous_tokens(world, monkeypatch, shape):
    """With 3 running at a time, finished requests' rows are handed to new ones mid-run. A
    tree's step verifies the device's trie and moves the accepted path's KV first."""
    # The tree's run is shorter (the interpreter's tree verify is slow): 3 prompts, 2 at a time.
    tree = shape == "tree"
    max_running, kw = (2, TREE) if tree else (3, {})
    prompts = _cycle_prompts(world, (30, 45, 41) if tree else (30, 45, 60, 70, 52, 41))
    _, sync = _ngram_run(world, prompts, disable_overlap_schedule=True,
                         max_running_requests=max_running, **kw)
    steps = []
    real = SpecOverlap.step
    monkeypatch.setattr(SpecOverlap, "step", lambda self: steps.append(1) or real(self))
    engine, over = _ngram_run(world, prompts, max_running_requests=max_running, **kw)
    assert len(steps) > 5, "no NGRAM step was overlapped"
    assert engine.get_server_info()["speculative"]["overlapped_steps"] == len(steps)
    hist = same_as_sync(over, sync, 5)
    # A tree's first 7 nodes in BFS order are mostly siblings: it accepts 1 draft at most here.
    assert hist[0] > 0 and sum(hist[1 if tree else 2:]) > 0, "NGRAM should both accept and miss"
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]
    assert not engine.draft.history._synced, "the history kept finished requests"


@needs_interpreter
def test_overlapped_ngram_steps_survive_preemption(world):
    """A KV cache too small for the batch: overlapped steps stop when a step's reservations do
    not fit, requests are preempted and prefilled again (their history rows copied anew), and
    the greedy tokens stay the synchronous loop's."""
    prompts = _cycle_prompts(world, (30, 45, 60, 70))
    _, sync = _ngram_run(world, prompts, disable_overlap_schedule=True)
    engine, over = _ngram_run(world, prompts, max_total_tokens=240)
    info = engine.get_server_info()
    assert info["num_preemptions"] > 0 and info["speculative"]["overlapped_steps"] > 0, info
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in sync]
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
