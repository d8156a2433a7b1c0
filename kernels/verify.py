"""Greedy verification of a draft tree (a chain is a tree): which drafts the target accepts.

Tree layout: see tree.py. After the TARGET_VERIFY forward, `target_predict[b, i]` is the target's
greedy token after node i (argmax of logits row b * N + i, computed under the tree mask).
The walk, per request: cur = 0 (the root); among the children of cur, in first_child /
next_sibling order, find the first whose token == target_predict[cur]; accept it, make it cur
and go one level down; stop when no child matches or max_depth drafts are accepted. The bonus
token is target_predict at the last accepted node: the target's own next token. The emitted
tokens, `draft_tokens[accept_index[1:accept_len + 1]]` then `bonus`, are exactly what greedy
decoding with the target emits (lossless).

Outputs (`VerifyResult`, shared with sampling.py):
- accept_index [bs, max_depth + 1] int64: node indices of the accepted path, starting with 0
  (the root), padded with -1;
- accept_len [bs] int64: the number of accepted DRAFT tokens (the root is not counted);
- bonus [bs]: the token emitted after the last accepted node (target_predict's dtype here).

The Triton kernel (verify_triton.py) runs one program per request, a scalar walk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import pick_triton, triton_module


class VerifyResult(NamedTuple):
    accept_index: torch.Tensor  # [bs, max_depth + 1] int64; 0 first, -1 padding
    accept_len: torch.Tensor  # [bs] int64; accepted drafts, root and bonus not counted
    bonus: torch.Tensor  # [bs] the token after the last accepted node


def check_tree_inputs(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                      next_sibling: torch.Tensor, max_depth: int | None) -> int:
    """Validates the tree tensors; returns max_depth (N - 1 when None)."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [bs, N], got {tuple(draft_tokens.shape)}")
    for name, t in (("first_child", first_child), ("next_sibling", next_sibling)):
        if t.shape != draft_tokens.shape:
            raise ValueError(f"{name} must be {tuple(draft_tokens.shape)}, got {tuple(t.shape)}")
    num_nodes = draft_tokens.shape[1]
    if num_nodes < 1:
        raise ValueError("a tree needs at least the root node (N >= 1)")
    if max_depth is None:
        return num_nodes - 1
    if not 0 <= max_depth <= num_nodes - 1:
        raise ValueError(f"max_depth must be in [0, {num_nodes - 1}], got {max_depth}")
    return max_depth


def _walk_step(draft_tokens, next_sibling, child, found, wanted):
    """One sibling step of the batched walk: where `child` is live and nothing is found yet,
    take it if its token is `wanted`, else move to its next sibling. -> (child, found)."""
    live = (child >= 0) & (found < 0)
    safe = child.clamp(min=0)
    hit = live & (draft_tokens.gather(1, safe[:, None])[:, 0] == wanted)
    found = torch.where(hit, child, found)
    child = torch.where(live & ~hit, next_sibling.gather(1, safe[:, None])[:, 0], child)
    return child, found


def verify_greedy_torch(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                        next_sibling: torch.Tensor, target_predict: torch.Tensor,
                        max_depth: int) -> VerifyResult:
    """The twin: the walk above, batched over requests (one depth, one sibling step at a time)."""
    bs, num_nodes = draft_tokens.shape
    device = draft_tokens.device
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int64,
                              device=device)  # [bs, max_depth + 1]
    accept_index[:, 0] = 0
    cur = torch.zeros(bs, dtype=torch.int64, device=device)  # [bs] last accepted node
    searching = torch.ones(bs, dtype=torch.bool, device=device)  # [bs] no mismatch yet
    for depth in range(1, max_depth + 1):
        wanted = target_predict.gather(1, cur[:, None])[:, 0]
        child = torch.where(searching, first_child.gather(1, cur[:, None])[:, 0], -1)
        found = torch.full_like(cur, -1)
        for _ in range(num_nodes - 1):  # a node has at most N - 1 children
            if not ((child >= 0) & (found < 0)).any():  # a host sync, worth it on CPU
                break
            child, found = _walk_step(draft_tokens, next_sibling, child, found, wanted)
        searching &= found >= 0
        accept_index[:, depth] = torch.where(searching, found, -1)
        cur = torch.where(searching, found, cur)
    accept_len = (accept_index >= 0).sum(dim=1) - 1
    bonus = target_predict.gather(1, cur[:, None])[:, 0]
    return VerifyResult(accept_index, accept_len, bonus)


def verify_greedy(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                  next_sibling: torch.Tensor, target_predict: torch.Tensor,
                  max_depth: int | None = None, *,
                  use_triton: bool | None = None) -> VerifyResult:
    """draft_tokens, first_child, next_sibling, target_predict: [bs, N] integer tensors
    (tree.Tree's fields; target_predict = the target's argmax after each node).
    max_depth: the deepest draft level (num_steps for EAGLE; default N - 1, always enough)."""
    max_depth = check_tree_inputs(draft_tokens, first_child, next_sibling, max_depth)
    if target_predict.shape != draft_tokens.shape:
        raise ValueError(f"target_predict must be {tuple(draft_tokens.shape)}, "
                         f"got {tuple(target_predict.shape)}")
    first_child, next_sibling = first_child.to(torch.int64), next_sibling.to(torch.int64)
    if not pick_triton(draft_tokens, use_triton):
        return verify_greedy_torch(draft_tokens, first_child, next_sibling, target_predict,
                                   max_depth)
    bs = draft_tokens.shape[0]
    device = draft_tokens.device
    # The kernel writes every column: no fill kernel before it.
    accept_index = torch.empty((bs, max_depth + 1), dtype=torch.int64,
                               device=device)  # [bs, max_depth + 1]
    accept_len = torch.empty(bs, dtype=torch.int64, device=device)  # [bs]
    bonus = torch.empty(bs, dtype=target_predict.dtype, device=device)  # [bs]
    triton_module("verify_triton").verify_greedy_triton(
        draft_tokens.contiguous(), first_child.contiguous(), next_sibling.contiguous(),
        target_predict.contiguous(), accept_index, accept_len, bonus)
    return VerifyResult(accept_index, accept_len, bonus)
