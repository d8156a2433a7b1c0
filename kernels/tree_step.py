"""One EAGLE-2 tree step's bookkeeping after its top-k: the step's candidates into the tree's
candidate grid, then (unless it is the last step) the K best of its K * K candidates as the next
step's branches, with their tokens, scores, parents and ancestry.

In torch that is about a dozen small kernels a step (an add, copies into the grid, a top-k, a
division, gathers and a concatenation); in a (5, 4, 8) tree at batch 16 each ran 1-8 us (H200,
benchmarks/results/step_eagle3_bs16_548_c5725e6_h200.txt). The Triton kernel
(tree_step_triton.py) is one program per request. The K best go largest first, equal scores
lowest index first: the rule of kernels.topk, which the twin calls.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .dispatch import pick_triton, triton_module
from .topk import topk_rows


class Branches(NamedTuple):
    """The next tree step's K branches per request."""

    scores: torch.Tensor  # [bs, K] fp32: cumulative log-prob of each branch's path
    tokens: torch.Tensor  # [bs, K]: the token each branch feeds
    parent: torch.Tensor  # [bs, K] int64: which branch of this step each grew from
    ancestors: torch.Tensor  # [bs, K, F + K] bool: the fed nodes each sees (itself last)


def advance_tree_torch(cand_tokens, cand_scores, branch_parents, top_ids, top_logp, scores,
                       ancestors, s: int) -> Optional[Branches]:
    """The twin of advance_tree (same arguments and results)."""
    bs, num_steps, k, _ = cand_tokens.shape
    cand_tokens[:, s] = top_ids
    cand_scores[:, s] = scores[:, :, None] + top_logp
    if s + 1 == num_steps:
        return None
    best_ids, best_scores = topk_rows(cand_scores[:, s].reshape(bs, k * k), k, use_triton=False)
    branch_parents[:, s + 1] = best_ids
    parent = best_ids // k
    tokens = cand_tokens[:, s].reshape(bs, k * k).gather(1, best_ids)
    seen = ancestors.gather(1, parent[..., None].expand(-1, -1, ancestors.shape[-1]))
    eye = torch.eye(k, dtype=torch.bool, device=seen.device).expand(bs, k, k)
    return Branches(best_scores, tokens, parent, torch.cat([seen, eye], dim=-1))


def advance_tree(cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                 branch_parents: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                 scores: torch.Tensor, ancestors: torch.Tensor, s: int,
                 use_triton: bool | None = None) -> Optional[Branches]:
    """Tree step s (1 <= s < S) of an expansion (drafts.tree_round.expand_tree): cand_tokens,
    cand_scores [bs, S, K, K] and branch_parents [bs, S, K] are the tree's grids (step s's row
    written here, and branch_parents[:, s + 1]); top_ids, top_logp [bs, K, K] the step's K best
    children of each branch; scores [bs, K] the branches' path scores; ancestors [bs, K, F] the
    fed nodes each branch saw. Returns the next step's Branches, or None after the last step.
    Never reads tensor values on the host (CUDA-graph safe)."""
    num_steps = cand_tokens.shape[1]
    if not 1 <= s < num_steps:
        raise ValueError(f"tree step s must be in [1, {num_steps - 1}], got {s}")
    if not pick_triton(cand_scores, use_triton):
        return advance_tree_torch(cand_tokens, cand_scores, branch_parents, top_ids, top_logp,
                                  scores, ancestors, s)
    return triton_module("tree_step_triton").advance_tree_triton(
        cand_tokens, cand_scores, branch_parents, top_ids, top_logp, scores, ancestors, s)
