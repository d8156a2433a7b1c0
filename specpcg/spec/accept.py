"""Accept: which drafts the target keeps, greedy or by speculative sampling (kernels/)."""

from __future__ import annotations

import torch

from kernels.sampling import verify_sampling
from kernels.verify import VerifyResult, verify_greedy
from specpcg.sampler import target_probs


def _target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """logits: [N, V] of one request -> its sampling distribution at every node [N, V]."""
    return torch.stack([target_probs(row, params) for row in logits])


def accept(reqs: list, tree, draft_probs, logits: torch.Tensor) -> VerifyResult:
    """logits: [bs, N, V] float32 from TARGET_VERIFY. Greedy requests take the argmax walk;
    others rejection-sample so that emitted tokens follow the target's distribution."""
    bs, num_nodes, _ = logits.shape
    max_depth = num_nodes - 1
    greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    device = logits.device
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.long, device=device)
    accept_len = torch.zeros(bs, dtype=torch.long, device=device)  # [bs]
    bonus = torch.zeros(bs, dtype=torch.long, device=device)  # [bs]
    parts = []
    if greedy:
        rows = torch.tensor(greedy, device=device)
        parts.append((rows, verify_greedy(tree.draft_tokens[rows], tree.first_child[rows],
                                          tree.next_sibling[rows], logits[rows].argmax(-1),
                                          max_depth)))
    if sampled:
        rows = torch.tensor(sampled, device=device)
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
