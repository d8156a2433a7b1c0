"""Speculative-decoding kernels: tree build, greedy and sampled verification, KV slot assignment.

Every Triton kernel equals its torch twin on random chains and trees (on CPU through the Triton
interpreter, on CUDA natively); the twins are checked on hand-worked examples and edge cases;
sampled verification is checked to keep the target's distribution (chi-square).
"""

import itertools
import os

import torch

# The interpreter flag is read when a kernel is decorated; kernels/ imports its Triton modules
# lazily, so setting it here, before the first Triton call, is enough.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.kv_slots import assign_accepted_slots  # noqa: E402
from kernels.sampling import verify_sampling  # noqa: E402
from kernels.tree import build_tree, chain_tree, tree_from_parents  # noqa: E402
from kernels.verify import verify_greedy  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
SHAPES = [(1, 1), (1, 2), (3, 5), (5, 16), (4, 9)]  # (bs, N)
PARENTS_7 = [-1, 0, 0, 1, 1, 2, 3]  # hand-worked: 0 -> 1, 2;  1 -> 3, 4;  2 -> 5;  3 -> 6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _equal(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.equal(a.cpu(), e.cpu()), (a, e)


def _walk(tree):
    """The tree tensors verification walks: (draft_tokens, first_child, next_sibling)."""
    return tree.draft_tokens, tree.first_child, tree.next_sibling


def _random_tree(bs, num_nodes, vocab, gen, chain=False, device="cpu"):
    """A random tree whose siblings carry distinct tokens (children of node j: a permutation)."""
    parents = torch.arange(num_nodes).repeat(bs, 1) - 1  # [bs, N] a chain
    for i in range(1, 1 if chain else num_nodes):
        parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
    perms = torch.rand(bs, num_nodes, vocab, generator=gen).argsort(-1)  # [bs, N, V]
    tokens = torch.randint(0, vocab, (bs, num_nodes), generator=gen)  # [bs, N]
    for i in range(1, num_nodes):
        rank = (parents[:, 1:i] == parents[:, i:i + 1]).sum(1)  # earlier siblings of node i
        tokens[:, i] = perms[torch.arange(bs), parents[:, i], rank]
    return tree_from_parents(tokens.to(device), parents.to(device), use_triton=False)


def _random_predict(tree, vocab, gen, p_match=0.8):
    """target_predict that mostly names one of the node's children, so walks go deep."""
    tokens, parents = tree.draft_tokens.cpu(), tree.parents.cpu()
    bs, num_nodes = tokens.shape
    is_child = parents[:, None, :] == torch.arange(num_nodes)[None, :, None]  # [bs, j, i]
    pick = torch.where(is_child, torch.rand(bs, num_nodes, num_nodes, generator=gen), -1.0)
    use = is_child.any(-1) & (torch.rand(bs, num_nodes, generator=gen) < p_match)
    predict = torch.where(use, tokens.gather(1, pick.argmax(-1)),
                          torch.randint(0, vocab, tokens.shape, generator=gen))
    return predict.to(tree.draft_tokens.device)


def _random_probs(tree, vocab, gen):
    """[bs, N, V] rows peaked on one child's token (so drafts are often accepted), with zeros."""
    bs, num_nodes = tree.draft_tokens.shape
    logits = torch.randn(bs, num_nodes, vocab, generator=gen)
    peak = _random_predict(tree, vocab, gen).cpu()[:, :, None]
    logits.scatter_add_(2, peak, torch.full(peak.shape, 3.0))
    logits[torch.rand(bs, num_nodes, vocab, generator=gen) < 0.2] = float("-inf")
    logits[:, :, 0] = 0.0  # at least one token with mass per row
    return torch.softmax(logits, -1).to(tree.draft_tokens.device)


def _random_candidates(bs, num_steps, topk, gen):
    """EAGLE-style drafting: cumulative log-probs; each step expands the K best candidates.
    Candidate (s, b, j) carries token 1000 + s K^2 + b K + j, so a tree node names its source."""
    tokens = (1000 + torch.arange(num_steps * topk * topk)).view(num_steps, topk, topk)
    tokens = tokens.repeat(bs, 1, 1, 1)  # [bs, S, K, K]
    logq = torch.log_softmax(torch.randn(bs, num_steps, topk, topk, generator=gen), -1)
    scores = logq.clone()
    branch_parents = torch.zeros(bs, num_steps, topk, dtype=torch.int64)
    prev = scores[:, 0, 0]  # [bs, K] step 0: the root's candidates
    for s in range(1, num_steps):
        branch_parents[:, s] = prev.topk(topk, dim=1).indices  # flat index into step s-1's grid
        scores[:, s] = prev.gather(1, branch_parents[:, s])[:, :, None] + logq[:, s]
        prev = scores[:, s].reshape(bs, -1)
    return torch.randint(0, 50, (bs,), generator=gen), tokens, scores, branch_parents


# ---- trees -----------------------------------------------------------------------------------

def test_tree_from_parents_hand_worked_and_chain():
    tree = tree_from_parents(torch.arange(7)[None], torch.tensor([PARENTS_7]), use_triton=False)
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 2, 3]]
    assert tree.first_child.tolist() == [[1, 3, 5, 6, -1, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1, -1]]
    attended = [set(torch.nonzero(row)[:, 0].tolist()) for row in tree.tree_mask[0]]
    assert attended == [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}]
    tokens = torch.randint(0, 9, (3, 6), generator=_gen(0))
    _equal(chain_tree(tokens), tree_from_parents(tokens, torch.arange(6).repeat(3, 1) - 1,
                                                 use_triton=False))
    assert chain_tree(tokens[:, :1]).tree_mask.tolist() == [[[True]]] * 3  # N = 1


def test_build_tree_hand_worked():
    # K = 2, S = 2. Step 0: root -> a (-0.1), b (-1.0). Step 1 expands a (flat 0) and b (flat 1):
    # a -> c (-0.1), d (-2.0); b -> e (-1.2), f (-3.0). The 4 best: a, c, b, e.
    a, b, c, d, e, f = 10, 11, 12, 13, 14, 15
    tokens = torch.tensor([[[[a, b], [0, 0]], [[c, d], [e, f]]]])
    scores = torch.tensor([[[[-0.1, -1.0], [0.0, 0.0]], [[-0.1, -2.0], [-1.2, -3.0]]]])
    inputs = (torch.tensor([7]), tokens, scores, torch.tensor([[[0, 0], [0, 1]]]))
    tree = build_tree(*inputs, 5, use_triton=False)
    assert tree.draft_tokens.tolist() == [[7, a, b, c, e]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]] and tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    # c ties with its parent a for the last place: the parent wins, the tree stays closed.
    assert build_tree(*inputs, 2, use_triton=False).draft_tokens.tolist() == [[7, a]]


@pytest.mark.parametrize("topk,num_steps", [(1, 4), (2, 3), (3, 2), (4, 2), (2, 1)])
def test_build_tree_keeps_best_closed_set(topk, num_steps):
    root, tokens, scores, branch_parents = _random_candidates(4, num_steps, topk, _gen(topk))
    num_draft = min(16, 1 + topk + (num_steps - 1) * topk * topk)
    tree = build_tree(root, tokens, scores, branch_parents, num_draft, use_triton=False)
    assert torch.equal(tree.draft_tokens[:, 0], root)
    assert ((tree.parents[:, 1:] >= 0) & (tree.parents[:, 1:] < torch.arange(1, num_draft))).all()
    grid = topk * topk
    for b in range(4):
        valid = torch.cat([scores[b, 0, 0], scores[b, 1:].flatten()])  # step 0: branch 0 only
        ids = torch.cat([tokens[b, 0, 0], tokens[b, 1:].flatten()])
        kept = tree.draft_tokens[b, 1:]
        assert set(kept.tolist()) == set(ids[valid.topk(num_draft - 1).indices].tolist())
        for node, token in enumerate(kept.tolist(), start=1):
            step, branch = (token - 1000) // grid, (token - 1000) % grid // topk
            parent_token = (root[b].item() if step == 0 else
                            1000 + (step - 1) * grid + branch_parents[b, step, branch].item())
            assert tree.draft_tokens[b, tree.parents[b, node]] == parent_token
    if topk == 1:  # a chain: build_tree must agree with chain_tree
        _equal(tree, chain_tree(tree.draft_tokens))


def _check_tree_kernel(device):
    gen = _gen(1)
    for (bs, num_nodes), chain in itertools.product(SHAPES, (False, True)):
        tree = _random_tree(bs, num_nodes, 16, gen, chain, device)
        _equal(tree_from_parents(tree.draft_tokens, tree.parents, use_triton=True), tree)
    # (topk, steps, N): the (5, 4, 8) tree, one node, every candidate, a grid past the
    # selection kernel's 128 candidates (the twin then), and exact ties of rounded scores.
    for topk, num_steps, num_draft, ties in [(1, 5, 6, False), (2, 3, 11, False),
                                             (4, 2, 16, False), (4, 5, 8, False),
                                             (4, 5, 1, False), (3, 3, 22, False),
                                             (4, 9, 30, False), (4, 5, 8, True),
                                             (3, 3, 12, True)]:
        inputs = [t.to(device) for t in _random_candidates(3, num_steps, topk, gen)]
        if ties:  # rounding keeps a child at or below its parent
            inputs[2] = (inputs[2] * 2).floor() / 2
        _equal(build_tree(*inputs, num_draft, use_triton=True),
               build_tree(*inputs, num_draft, use_triton=False))


# ---- greedy verification ---------------------------------------------------------------------

def _walk_reference(tokens, first_child, next_sibling, predict, max_depth):
    """The walk of one request, in plain Python lists -> (accepted path, bonus)."""
    path = [0]
    while len(path) <= max_depth:
        child = first_child[path[-1]]
        while child != -1 and tokens[child] != predict[path[-1]]:
            child = next_sibling[child]
        if child == -1:
            break
        path.append(child)
    return path, predict[path[-1]]


def test_verify_greedy_hand_worked_and_edges():
    tokens = torch.tensor([[5, 10, 11, 12, 13, 14, 15]])
    tree = tree_from_parents(tokens, torch.tensor([PARENTS_7]), use_triton=False)
    # root -> 10 (node 1), node 1 -> 13 (node 4, the second child), node 4 is a leaf: bonus 42.
    predict = torch.tensor([[10, 13, 14, 99, 42, 0, 0]])
    result = verify_greedy(*_walk(tree), predict, use_triton=False)
    assert [t.tolist() for t in result] == [[[0, 1, 4, -1, -1, -1, -1]], [2], [42]]
    # Nothing accepted: the root predicts no child's token; the bonus is the root's prediction.
    predict[0, 0] = 77
    result = verify_greedy(*_walk(tree), predict, 3, use_triton=False)
    assert [t.tolist() for t in result] == [[[0, -1, -1, -1]], [0], [77]]
    # A chain accepted to the end, and N = 1 (no drafts, just the bonus).
    tree = chain_tree(torch.tensor([[1, 2, 3, 4]]))
    result = verify_greedy(*_walk(tree), torch.tensor([[2, 3, 4, 9]]), use_triton=False)
    assert [t.tolist() for t in result] == [[[0, 1, 2, 3]], [3], [9]]
    tree = chain_tree(torch.tensor([[1]]))
    result = verify_greedy(*_walk(tree), torch.tensor([[8]]), use_triton=False)
    assert [t.tolist() for t in result] == [[[0]], [0], [8]]


def _check_greedy_kernel(device, use_triton=True):
    """The twin against the plain-Python walk; with use_triton, the kernel against the twin."""
    gen = _gen(3)
    for (bs, num_nodes), chain in itertools.product(SHAPES, (False, True)):
        tree = _random_tree(bs, num_nodes, 16, gen, chain, device)
        predict = _random_predict(tree, 16, gen)
        for max_depth in {num_nodes - 1, min(2, num_nodes - 1)}:
            result = verify_greedy(*_walk(tree), predict, max_depth, use_triton=False)
            if use_triton:
                _equal(verify_greedy(*_walk(tree), predict, max_depth, use_triton=True), result)
            for b in range(bs):
                lists = [t[b].tolist() for t in (*_walk(tree), predict)]
                path, bonus = _walk_reference(*lists, max_depth)
                assert result.accept_index[b].tolist() == path + [-1] * (max_depth + 1 - len(path))
                assert result.accept_len[b] == len(path) - 1 and result.bonus[b] == bonus


def test_verify_greedy_twin_matches_reference_walk():
    _check_greedy_kernel("cpu", use_triton=False)


# ---- speculative sampling --------------------------------------------------------------------

def test_verify_sampling_hand_worked():
    tree = chain_tree(torch.tensor([[7, 1]]))
    target = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    draft = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.25, 0.75, 0.0, 0.0]]])

    def run(draft_probs, coins, final_coin):
        return verify_sampling(*_walk(tree), target, draft_probs, torch.tensor([coins]),
                               torch.tensor([final_coin]), use_triton=False)
    # With a draft: accept 1 w.p. min(1, 0.5 / 0.75) = 2/3; the bonus comes from node 1's row.
    accepted = run(draft, [0.0, 0.5], 0.95)
    assert accepted.accept_index.tolist() == [[0, 1]] and accepted.bonus.tolist() == [3]
    # Rejected: the residual relu(p - q) = [0.25, 0, 0, 0] leaves only token 0.
    rejected = run(draft, [0.0, 0.9], 0.99)
    assert rejected.accept_len.tolist() == [0] and rejected.bonus.tolist() == [0]
    # Target-only: accept 1 w.p. p(1) = 0.5; on rejection sample p without token 1: only 0.
    assert run(None, [0.0, 0.49], 0.0).accept_len.tolist() == [1]
    assert run(None, [0.0, 0.51], 0.99).bonus.tolist() == [0]
    # Siblings: the root's children are tokens 0 (node 1) and 1 (node 2); p = [.2, .3, .5].
    tree = tree_from_parents(torch.tensor([[9, 0, 1]]), torch.tensor([[-1, 0, 0]]))
    target = torch.tensor([[[0.2, 0.3, 0.5], [1.0, 0, 0], [0, 1.0, 0]]])
    # Target-only: reject 0 (coin .5 >= .2); residual [0, .375, .625] accepts 1 (coin .3).
    assert run(None, [0.0, 0.5, 0.3], 0.0).accept_index.tolist() == [[0, 2, -1]]
    # Draft q = [.5, .5, 0]: reject 0 (.5 * .5 >= .2); p' = norm(relu(p - q)) = [0, 0, 1] and
    # q' = [0, 1, 0] reject 1 whatever the coin; the bonus is token 2.
    draft = torch.tensor([[[0.0, 0, 0], [0.5, 0.5, 0], [0.5, 0.5, 0]]])
    result = run(draft, [0.0, 0.5, 0.0], 0.0)
    assert result.accept_len.tolist() == [0] and result.bonus.tolist() == [2]
    # N = 1: just the bonus, by inverse CDF of the root's row: CDF [.2, .5, 1] passes .4 at 1.
    tree, target = chain_tree(torch.tensor([[7]])), target[:, :1]
    result = run(None, [0.0], 0.4)
    assert result.accept_index.tolist() == [[0]] and result.bonus.tolist() == [1]


def _check_sampling_kernel(device):
    gen = _gen(4)
    # V = 1500 takes two blocks of the kernel's loops over the vocabulary.
    for (bs, num_nodes), (chain, vocab) in itertools.product(SHAPES, [(0, 16), (1, 16), (0, 1500)]):
        tree = _random_tree(bs, num_nodes, vocab, gen, chain, device)
        target, draft = _random_probs(tree, vocab, gen), _random_probs(tree, vocab, gen)
        coins = torch.rand(bs, num_nodes, generator=gen).to(device)
        final_coins = torch.rand(bs, generator=gen).to(device)
        for draft_probs in (None, draft):
            args = (*_walk(tree), target, draft_probs, coins, final_coins)
            _equal(verify_sampling(*args, use_triton=True),
                   verify_sampling(*args, use_triton=False))


# ---- the sampled tokens follow the target distribution ---------------------------------------

VOCAB = 8
DIST_ROWS = 100_000  # draws, one batch row each (the same request, different coins)


def _markov_rows(gen):
    """[V + 1, V]: row V is the distribution after the root, row t the one after token t.
    Peaked rows make the first siblings carry much draft mass, which a wrong q update shows."""
    return torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=gen) * 2.0, -1)


def _draws(parents, target_rows, draft_rows, sample_drafts, gen):
    """Draft tokens, draft_probs and target_probs for DIST_ROWS copies of one request; siblings
    are drawn without replacement from the draft (or are its top-k when not sampled)."""
    num_nodes = len(parents)
    tokens = torch.zeros(DIST_ROWS, num_nodes, dtype=torch.int64)  # [rows, N]; root: any
    draft_probs = torch.zeros(DIST_ROWS, num_nodes, VOCAB)  # [rows, N, V]
    context = torch.full((DIST_ROWS, num_nodes), VOCAB)  # the Markov row each node's token uses
    for node in sorted(set(parents[1:])):
        children = [i for i in range(num_nodes) if parents[i] == node]
        dist = draft_rows[context[:, node]]  # [rows, V] the draft after `node`
        picks = (torch.multinomial(dist, len(children), generator=gen) if sample_drafts
                 else dist.topk(len(children), dim=-1).indices)
        tokens[:, children] = picks
        draft_probs[:, children] = dist[:, None]
        context[:, children] = picks
    return tokens, draft_probs, target_rows[context]


def _chi2_pvalue(tokens, probs):
    """tokens: [n] draws; probs: [V] -> p-value of a chi-square goodness-of-fit test."""
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    assert observed[probs == 0].sum() == 0, "a token without target mass was emitted"
    keep = probs > 0
    expected = observed.sum() * probs.double()
    chi2 = ((observed - expected)[keep] ** 2 / expected[keep]).sum()
    return torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2), chi2 / 2).item()


def _check_distribution(parents, with_draft, device, use_triton, seed):
    gen = _gen(seed)
    target_rows = _markov_rows(gen)
    target_rows[:, -1] = 0.0  # a token top-k / top-p filtering removed
    target_rows /= target_rows.sum(-1, keepdim=True)
    draft_rows = 0.6 * target_rows + 0.4 * _markov_rows(gen)  # a draft that roughly agrees
    tokens, draft_probs, target_probs = _draws(parents, target_rows, draft_rows, with_draft, gen)
    tree = tree_from_parents(tokens, torch.tensor([parents]).repeat(DIST_ROWS, 1),
                             use_triton=False)
    coins = torch.rand(DIST_ROWS, len(parents), generator=gen)
    final_coins = torch.rand(DIST_ROWS, generator=gen)
    result = verify_sampling(
        tokens.to(device), tree.first_child.to(device), tree.next_sibling.to(device),
        target_probs.to(device), draft_probs.to(device) if with_draft else None,
        coins.to(device), final_coins.to(device), int(tree.depths.max()), use_triton=use_triton)
    accept_index, accept_len, bonus = (t.cpu() for t in result)
    path_tokens = tokens.gather(1, accept_index.clamp(min=0))  # [rows, W]
    first = torch.where(accept_len >= 1, path_tokens[:, 1], bonus)
    assert accept_len.float().mean() > 0.3, accept_len.float().mean()  # acceptance is exercised
    assert _chi2_pvalue(first, target_rows[VOCAB]) > 1e-3
    # After an accepted first draft t, the next token must follow the target's row after t.
    second = torch.where(accept_len >= 2, path_tokens[:, 2], bonus)
    for t in range(VOCAB):
        rows = (accept_len >= 1) & (first == t)
        if rows.sum() >= 200:
            assert _chi2_pvalue(second[rows], target_rows[t]) > 1e-3, t


# A chain, and a tree whose root has three children (sibling trials are where bugs hide).
DIST_CASES = [([-1, 0, 1, 2], True), ([-1, 0, 1, 2], False),
              ([-1, 0, 0, 0, 1, 1, 2, 4], True), ([-1, 0, 0, 0, 1, 1, 2, 4], False)]


@pytest.mark.parametrize("device,use_triton", [("cpu", False),  # the interpreter is too slow
                                               pytest.param("cuda", True, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("parents,with_draft", DIST_CASES)
def test_sampling_keeps_target_distribution(parents, with_draft, device, use_triton):
    _check_distribution(parents, with_draft, device, use_triton, seed=0)


# ---- KV slots --------------------------------------------------------------------------------

@pytest.mark.parametrize("accept_index,kept_slots,rejected", [
    ([0, 2, 5, -1], [100, 102, 105], [0, 1, 0, 1, 1, 0, 1]),  # the path root -> 2 -> 5
    ([0, 1, 2, -1, -1], [100, 101, 102], [0, 0, 0, 1, 1, 1, 1])])  # a chain: its first slots
def test_assign_accepted_slots_hand_worked(accept_index, kept_slots, rejected):
    """Request 2 of a [3, 20] table, prefix_len 4, accept_len 2; node i's KV is in slot 100 + i."""
    table = torch.arange(60, dtype=torch.int32).view(3, 20)
    expected = table.clone()
    expected[2, 4:7] = torch.tensor(kept_slots)  # positions 4 .. 6, nothing else
    mask = assign_accepted_slots(table, torch.tensor([2]), torch.tensor([4]),
                                 torch.arange(100, 107)[None], torch.tensor([accept_index]),
                                 torch.tensor([2]), use_triton=False)
    assert mask.int().tolist() == [rejected] and torch.equal(table, expected)


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_interpreter)])
def test_assign_accepted_slots_in_place_view(use_triton):
    """draft_slots read straight out of req_to_token: path positions are rewritten safely."""
    req_to_token = torch.arange(40, dtype=torch.int32).reshape(2, 20) + 500
    draft_slots = req_to_token[1, 3:10]  # the verify's 7 slots, at positions 3 .. 9
    expected = draft_slots[[0, 1, 3, 6]].clone()
    assign_accepted_slots(req_to_token, torch.tensor([1]), torch.tensor([3]), draft_slots[None],
                          torch.tensor([[0, 1, 3, 6]]), torch.tensor([3]), use_triton=use_triton)
    assert torch.equal(req_to_token[1, 3:7], expected)


def _check_slots_kernel(device):
    gen = _gen(5)
    for bs, num_nodes in SHAPES:
        tree = _random_tree(bs, num_nodes, 16, gen, device=device)
        result = verify_greedy(*_walk(tree), _random_predict(tree, 16, gen), use_triton=False)
        table_twin = torch.randint(0, 1000, (bs + 2, 40), generator=gen, dtype=torch.int32)
        pool_rows = torch.randperm(bs + 2, generator=gen)[:bs]  # [R = bs + 2, C = 40] table
        prefix_lens = torch.randint(0, 40 - num_nodes, (bs,), generator=gen)
        draft_slots = torch.randperm(1000, generator=gen)[:bs * num_nodes].view(bs, -1)
        args = [t.to(device) for t in (pool_rows, prefix_lens, draft_slots)] + list(result[:2])
        table_twin = table_twin.to(device)
        table_triton = table_twin.clone()
        rejected = assign_accepted_slots(table_triton, *args, use_triton=True)
        assert torch.equal(rejected, assign_accepted_slots(table_twin, *args, use_triton=False))
        assert torch.equal(table_triton, table_twin)
        assert torch.equal((~rejected).sum(1), result.accept_len + 1)


# ---- Triton kernels = torch twins: on CPU through the interpreter, on CUDA compiled ----------

@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("check", [_check_tree_kernel, _check_greedy_kernel,
                                   _check_sampling_kernel, _check_slots_kernel])
def test_kernels_match_twins(check, device):
    check(device)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_verify_greedy_kernel_writes_minus_one_past_the_path_over_any_old_values(device):
    """The launcher hands the kernel an unfilled accept_index: every column past the accepted
    path must come out -1 whatever the memory held."""
    from kernels.verify_triton import verify_greedy_triton

    tree = chain_tree(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device=device))
    predict = torch.tensor([[2, 9, 9, 9], [6, 7, 8, 0]], device=device)  # accepts 1, then 3
    accept_index = torch.full((2, 4), 99, dtype=torch.int64, device=device)
    accept_len = torch.empty(2, dtype=torch.int64, device=device)
    bonus = torch.empty(2, dtype=torch.int64, device=device)
    draft, first_child, next_sibling = _walk(tree)
    verify_greedy_triton(draft, first_child.long(), next_sibling.long(), predict, accept_index,
                         accept_len, bonus)
    assert accept_index.tolist() == [[0, 1, -1, -1], [0, 1, 2, 3]]
    assert accept_len.tolist() == [1, 3] and bonus.tolist() == [9, 0]
