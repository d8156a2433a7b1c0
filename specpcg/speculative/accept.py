"""Accept: which drafts the target keeps, greedy or by speculative sampling (kernels/).

Also the BENCHMARK-ONLY synthetic acceptance (`speculative_simulate_accept_prob`, like SGLang's
SGLANG_SIMULATE_ACC_LEN): greedy requests then ignore the target's verdict and accept each next
draft along the first-child chain with probability p, so the accept length is whatever the
benchmark asks for (E[AL] = sum_{i=0..k} p^i over a chain of k drafts). Outputs are NOT lossless
in that mode: accepted drafts are emitted whether or not the target agrees.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kernels.sampling import verify_sampling
from kernels.verify import VerifyResult, verify_greedy
from specpcg.sampler import target_probs
from specpcg.transfer import to_device


def _target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """logits: [N, V] of one request -> its sampling distribution at every node [N, V]."""
    return torch.stack([target_probs(row, params) for row in logits])


class SimulatedAccept:
    """Per-engine state of the synthetic acceptance: p and a seeded generator (made on the
    device of the first logits it sees), so a run is deterministic for a given random_seed."""

    def __init__(self, prob: float, seed: int):
        self.prob, self.seed = prob, seed
        self.generator: Optional[torch.Generator] = None

    @staticmethod
    def from_spec(spec) -> Optional["SimulatedAccept"]:
        """None unless spec.simulate_accept_prob is set; then warns once (engine start)."""
        prob = spec.simulate_accept_prob
        if prob is None:
            return None
        logging.getLogger("specpcg").warning(
            "speculative_simulate_accept_prob=%s: SYNTHETIC acceptance for benchmarking; greedy "
            "outputs are NOT the target's (not lossless)", prob)
        return SimulatedAccept(prob, spec.simulate_seed)

    def coins(self, shape: tuple, device: torch.device) -> torch.Tensor:
        if self.generator is None:  # one engine, one device
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return torch.rand(shape, generator=self.generator, device=device) < self.prob


def simulate_accept(first_child: torch.Tensor, depths: torch.Tensor, target_predict: torch.Tensor,
                    accepted: torch.Tensor) -> VerifyResult:
    """BENCHMARK ONLY. first_child, depths, target_predict: [bs, N] (tree fields; argmax after
    each node); accepted: [bs, N - 1] bool coins. Walks the first-child chain from the root,
    taking level d's node while accepted[:, d - 1] holds and a child exists; the bonus is the
    target's argmax at the last accepted node. Same VerifyResult layout as verify_greedy.

    NOTE: one greedy walk (verify_greedy: one kernel on the GPU) over a stand-in tree, not a
    loop over depths here: that loop queued about 90 small kernels a step, which the efficiency
    benchmarks then counted as the framework's cost. In the stand-in every node's token is its
    own index and only first children exist, and node i "predicts" its first child where the
    coin of its depth came up, so the walk takes exactly the nodes the coins accept."""
    bs, num_nodes = first_child.shape
    nodes = torch.arange(num_nodes, device=first_child.device).expand(bs, num_nodes)
    coin = accepted.gather(1, depths.clamp(max=max(num_nodes - 2, 0))) if num_nodes > 1 \
        else torch.zeros_like(first_child, dtype=torch.bool)
    wanted = torch.where(coin & (depths < num_nodes - 1), first_child, -1)
    walk = verify_greedy(nodes, first_child, torch.full_like(first_child, -1), wanted,
                         num_nodes - 1)
    last = walk.accept_index.gather(1, walk.accept_len[:, None])
    return VerifyResult(walk.accept_index, walk.accept_len, target_predict.gather(1, last)[:, 0])


def simulate_accept_chain(tree, target_predict: torch.Tensor,
                          coins: torch.Tensor) -> VerifyResult:
    """BENCHMARK ONLY. simulate_accept over a chain's Tree (kernels.tree.chain_tree), with
    coins [bs, N] of which the last column is False: node j's child is taken while coin j
    holds. Three kernels where the tree form takes about ten, which the batch-1 efficiency
    benchmark would count as the step's cost (a chain's depths are its node indices, its
    siblings none: the walk's stand-in tokens and siblings are the tree's own tensors)."""
    # A chain has no siblings: next_sibling is all -1, the "no node" a python -1 would be (a
    # scalar operand costs a fill kernel on the GPU).
    wanted = torch.where(coins, tree.first_child, tree.next_sibling)
    walk = verify_greedy(tree.depths, tree.first_child, tree.next_sibling, wanted,
                         coins.shape[1] - 1)
    bonus = target_predict.gather(1, walk.accept_len[:, None])[:, 0]
    return VerifyResult(walk.accept_index, walk.accept_len, bonus)


def accept(reqs: list, tree, draft_probs, logits: torch.Tensor,
           simulate: Optional[SimulatedAccept] = None) -> VerifyResult:
    """logits: [bs, N, V] float32 from TARGET_VERIFY. Greedy requests take the argmax walk;
    others rejection-sample so that emitted tokens follow the target's distribution.
    simulate (benchmark only): greedy requests take simulate_accept instead."""
    bs, num_nodes, _ = logits.shape
    max_depth = num_nodes - 1
    greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    if not sampled and simulate is None:  # the common case: no gathers, no host-built index
        return verify_greedy(tree.draft_tokens, tree.first_child, tree.next_sibling,
                             logits.argmax(-1), max_depth)
    device = logits.device
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.long, device=device)
    accept_len = torch.zeros(bs, dtype=torch.long, device=device)  # [bs]
    bonus = torch.zeros(bs, dtype=torch.long, device=device)  # [bs]
    parts = []
    if greedy:
        rows = to_device(greedy, device)
        predict = logits[rows].argmax(-1)  # [n, N]
        if simulate is not None:
            coins = simulate.coins((len(greedy), max_depth), device)
            parts.append((rows, simulate_accept(tree.first_child[rows], tree.depths[rows],
                                                  predict, coins)))
        else:
            parts.append((rows, verify_greedy(tree.draft_tokens[rows], tree.first_child[rows],
                                              tree.next_sibling[rows], predict, max_depth)))
    if sampled:
        rows = to_device(sampled, device)
        probs = torch.stack([_target_probs(logits[i], reqs[i].params) for i in sampled])
        coins = torch.stack([torch.rand(num_nodes + 1, generator=reqs[i].generator,
                                        device=device) for i in sampled])  # [n, N + 1]
        q = None if draft_probs is None else draft_probs[rows]
        parts.append((rows, verify_sampling(tree.draft_tokens[rows], tree.first_child[rows],
                                            tree.next_sibling[rows], probs, q, coins[:, :-1],
                                            coins[:, -1], max_depth)))
    for rows, res in parts:
        accept_index[rows] = res.accept_index
        accept_len[rows] = res.accept_len
        bonus[rows] = res.bonus.long()
    return VerifyResult(accept_index, accept_len, bonus)
