"""Synthetic acceptance (speculative_simulate_accept_prob, benchmark only) on CPU: the accept
length follows p, p=1 accepts every draft, bad values are refused, and without the option the
lossless path is untouched."""

import importlib.util
import math
import os

import pytest
import torch

from specpcg import Engine
from specpcg.speculative.accept import simulate_accept

STEPS = 4  # chain: 5 draft tokens (root + 4 drafts)
GREEDY = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_path):
    return tiny_path


@pytest.fixture(scope="module")
def prompts():
    """Repeated random segments: the n-gram index always has a continuation to propose."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (6,), generator=gen).tolist() * 5 for _ in range(6)]


def _engine(model_dir, **kw):
    return Engine(model_path=model_dir, device="cpu", dtype="float32", skip_tokenizer_init=True,
                  max_total_tokens=4096, **kw)


def _spec_engine(model_dir, prob=None, **kw):
    return _engine(model_dir, speculative_algorithm="NGRAM", speculative_num_steps=STEPS,
                   speculative_simulate_accept_prob=prob, **kw)


def _expected(p: float, k: int) -> tuple:
    """(mean, variance) of one verify step's accept length over a chain of k drafts:
    P(AL = j) = p^(j-1) (1 - p) for j <= k, P(AL = k + 1) = p^k."""
    dist = {j: p ** (j - 1) * (1 - p) for j in range(1, k + 1)} | {k + 1: p ** k}
    mean = sum(j * q for j, q in dist.items())
    return mean, sum((j - mean) ** 2 * q for j, q in dist.items())


@pytest.mark.parametrize("p", [0.3, 0.8])
def test_accept_length_follows_p(model_dir, prompts, p):
    engine = _spec_engine(model_dir, p)
    assert engine.spec_decoder.simulate is not None
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert all(o["meta_info"]["completion_tokens"] == 64 for o in outs)
    assert all(0 <= t < 128 for o in outs for t in o["output_ids"])
    state = engine.get_server_info()["internal_states"][0]
    n, hist = state["spec_verify_ct"], state["spec_accept_histogram"]
    per_req = [sum(col) for col in zip(*(o["meta_info"]["spec_accept_histogram"] for o in outs))]
    assert per_req == [hist.get(m, 0) for m in range(STEPS + 1)] and sum(per_req) == n
    # Chains are always full length (NGRAM pads them), so the expectation is exact.
    mean, var = _expected(p, STEPS)
    tol = 4 * math.sqrt(var / n)
    avg = state["avg_spec_accept_length"]
    assert abs(avg - mean) < tol, f"p={p}: AL {avg:.3f} vs expected {mean:.3f} +- {tol:.3f}"


def test_deterministic_for_a_seed(model_dir, prompts):
    params = {**GREEDY, "max_new_tokens": 24}

    def run(seed):
        engine = _spec_engine(model_dir, 0.5, random_seed=seed)
        return [o["output_ids"] for o in engine.generate(input_ids=prompts[:2],
                                                         sampling_params=params)]

    first = run(0)
    assert run(0) == first and run(1) != first  # another seed flips other coins


def test_p_one_accepts_every_draft(model_dir, prompts):
    engine = _spec_engine(model_dir, 1.0)
    engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)
    state = engine.get_server_info()["internal_states"][0]
    assert state["avg_spec_accept_length"] == STEPS + 1
    assert set(state["spec_accept_histogram"]) == {STEPS}
    # Sampled requests still go through rejection sampling and finish.
    out = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "temperature": 0.8})
    assert out["meta_info"]["completion_tokens"] == 64


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -1, float("nan"), "0.5", True])
def test_bad_values_are_refused(model_dir, bad):
    with pytest.raises(ValueError, match="speculative_simulate_accept_prob"):
        _spec_engine(model_dir, bad)


def test_needs_an_algorithm(model_dir):
    with pytest.raises(ValueError, match="speculative_simulate_accept_prob"):
        _engine(model_dir, speculative_simulate_accept_prob=0.5)


def test_without_the_option_outputs_are_unchanged(model_dir, prompts):
    params = {**GREEDY, "max_new_tokens": 32}
    plain = _engine(model_dir).generate(input_ids=prompts[:4], sampling_params=params)
    engine = _spec_engine(model_dir)
    assert engine.spec_decoder.simulate is None
    assert engine.get_server_info()["speculative"]["simulate_accept_prob"] is None
    spec = engine.generate(input_ids=prompts[:4], sampling_params=params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]


def test_simulate_accept_walks_the_first_child_chain():
    # Request 0: chain 0 -> 1 -> 2 -> 3; request 1: a tree whose root's first child is 2 (a leaf).
    first_child = torch.tensor([[1, 2, 3, -1], [2, -1, -1, -1]])
    depths = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 2]])
    predict = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    coins = torch.tensor([[True, True, False], [True, True, True]])
    res = simulate_accept(first_child, depths, predict, coins)
    assert res.accept_len.tolist() == [2, 1]
    assert res.accept_index.tolist() == [[0, 1, 2, -1], [0, 2, -1, -1]]
    assert res.bonus.tolist() == [12, 22]


def _walk_by_depth(first_child, predict, coins):
    """The walk written plainly, one depth at a time: the reference for simulate_accept."""
    index, lens, bonus = [], [], []
    for fc, pr, co in zip(first_child.tolist(), predict.tolist(), coins.tolist()):
        path = [0]
        while len(path) < len(fc) and fc[path[-1]] >= 0 and co[len(path) - 1]:
            path.append(fc[path[-1]])
        index.append(path + [-1] * (len(fc) - len(path)))
        lens.append(len(path) - 1)
        bonus.append(pr[path[-1]])
    return index, lens, bonus


@pytest.mark.parametrize("seed", range(4))
def test_simulate_accept_matches_a_plain_walk_on_random_trees(seed):
    from kernels.tree import tree_from_parents

    gen = torch.Generator().manual_seed(seed)
    bs, n = 6, 8
    parents = torch.stack([torch.cat([torch.tensor([-1]), torch.stack(
        [torch.randint(0, i, (1,), generator=gen)[0] for i in range(1, n)])]) for _ in range(bs)])
    tokens = torch.randint(0, 100, (bs, n), generator=gen)
    tree = tree_from_parents(tokens, parents)
    predict = torch.randint(0, 100, (bs, n), generator=gen)
    coins = torch.rand(bs, n - 1, generator=gen) < 0.7
    res = simulate_accept(tree.first_child, tree.depths, predict, coins)
    index, lens, bonus = _walk_by_depth(tree.first_child, predict, coins)
    assert res.accept_index.tolist() == index
    assert res.accept_len.tolist() == lens
    assert res.bonus.tolist() == bonus


@pytest.mark.parametrize("seed", range(4))
def test_the_chain_form_walks_as_the_tree_form(seed):
    """simulate_accept_chain (the step graph's, for chains) takes the nodes, length and bonus
    of simulate_accept with the same coins, its last column (no child there) False."""
    from kernels.tree import chain_tree
    from specpcg.speculative.accept import simulate_accept_chain

    gen = torch.Generator().manual_seed(seed)
    bs, n = 6, 8
    tree = chain_tree(torch.randint(0, 100, (bs, n), generator=gen))
    predict = torch.randint(0, 100, (bs, n), generator=gen)
    coins = torch.rand(bs, n - 1, generator=gen) < 0.6
    coins[0] = True  # every draft accepted
    want = simulate_accept(tree.first_child, tree.depths, predict, coins)
    got = simulate_accept_chain(tree, predict, torch.cat([coins, coins[:, :1] & False], 1))
    assert got.accept_len.tolist()[0] == n - 1
    for name in ("accept_index", "accept_len", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                    or importlib.util.find_spec("triton") is None,
                    reason="overlapped steps need the Triton backend (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("p", [0.6, 1.0])
def test_overlapped_chain_steps_follow_p(model_dir, prompts, p):
    """The step graph's body (here eager) draws its coins on the device: p = 1 accepts every
    draft of every step, p = 0.6 gives the chain's expected accept length."""
    engine = _spec_engine(model_dir, p, attention_backend="triton",
                          disable_adaptive_speculation=True)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert engine.scheduler.spec_overlap.num_steps > 0
    assert all(o["meta_info"]["completion_tokens"] == 64 for o in outs)
    state = engine.get_server_info()["internal_states"][0]
    if p == 1.0:
        assert set(state["spec_accept_histogram"]) == {STEPS}
        return
    mean, var = _expected(p, STEPS)
    tol = 4 * math.sqrt(var / state["spec_verify_ct"])
    assert abs(state["avg_spec_accept_length"] - mean) < tol
