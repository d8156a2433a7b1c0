"""Draft trees: build one from EAGLE-style top-k drafting, from a chain, or from a parent array.

Layout, per request, N = num_draft_tokens nodes:

- node 0 is the root: the last verified token (not a draft); its KV is written by the verify
  forward, at position prefix_len;
- nodes 1..N-1 are drafts in BFS / creation order, so `parents[i] < i` for every i >= 1;
- node i sits at position `prefix_len + depths[i]` and, in the verify forward, attends the
  prefix plus the nodes j with `tree_mask[i, j]`: j is i or one of i's ancestors;
- children of a node are listed by `first_child` / `next_sibling` in ascending node order
  (-1 = none); the verify walk tries children in that order.

All structure tensors are int64 (they index other tensors); the mask is bool.
`tree_from_parents` and the node selection of `build_tree` each have a Triton kernel (one
program per request, tree_triton.py) and a torch twin. The twin's selection (a stable sort, a
second sort, scatters and gathers) ran as about 25 kernels of 1-5 us each in every EAGLE3 tree
step on the H200 (benchmarks/results/step_eagle3_bs16_548_c5725e6_h200.txt); the kernel ranks
the candidates by pairwise comparison in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import pick_triton, triton_module


MAX_SELECT = 128  # candidates the selection kernel ranks in registers ([C, C] comparisons)


class Tree(NamedTuple):
    draft_tokens: torch.Tensor  # [bs, N] token ids; node 0 = the root (last verified token)
    parents: torch.Tensor  # [bs, N] int64; -1 at the root, parents[i] < i elsewhere
    depths: torch.Tensor  # [bs, N] int64; 0 at the root; position = prefix_len + depth
    tree_mask: torch.Tensor  # [bs, N, N] bool; [b, i, j]: node i attends node j
    first_child: torch.Tensor  # [bs, N] int64; -1 = leaf
    next_sibling: torch.Tensor  # [bs, N] int64; -1 = last child of its parent


# ---- from a parent array (NGRAM trees, and the last step of build_tree) ----------------------

def tree_from_parents_torch(draft_tokens: torch.Tensor, parents: torch.Tensor) -> Tree:
    """The twin: walk nodes in order; a parent precedes its child, so its row is already done."""
    bs, num_nodes = parents.shape
    device = parents.device
    rows = torch.arange(bs, device=device)
    nodes = torch.arange(num_nodes, device=device)
    tree_mask = torch.eye(num_nodes, dtype=torch.bool, device=device).repeat(bs, 1, 1)  # [bs,N,N]
    depths = torch.zeros(bs, num_nodes, dtype=torch.int64, device=device)  # [bs, N]
    for i in range(1, num_nodes):
        parent = parents[:, i]
        tree_mask[:, i] |= tree_mask[rows, parent]
        depths[:, i] = depths[rows, parent] + 1
    # is_child[b, i, j]: node j's parent is node i. Children keep ascending node order.
    is_child = parents[:, None, :] == nodes[None, :, None]  # [bs, N, N]
    first_child = _first_true(is_child, nodes)
    # later_sibling[b, i, j]: j > i shares i's parent (the root has no siblings).
    later_sibling = ((parents[:, None, :] == parents[:, :, None])
                     & (nodes[None, None, :] > nodes[None, :, None])
                     & (parents[:, :, None] >= 0))  # [bs, N, N]
    next_sibling = _first_true(later_sibling, nodes)
    return Tree(draft_tokens, parents, depths, tree_mask, first_child, next_sibling)


def _first_true(flags: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """[bs, N, N] bool -> [bs, N]: the smallest j with flags[b, i, j], or -1."""
    num_nodes = flags.shape[-1]
    first = torch.where(flags, nodes, num_nodes).amin(dim=-1)
    return torch.where(first == num_nodes, -1, first)


def tree_from_parents(draft_tokens: torch.Tensor, parents: torch.Tensor, *,
                      use_triton: bool | None = None) -> Tree:
    """draft_tokens, parents: [bs, N] (node 0 = root, parents[:, 0] = -1, 0 <= parents[:, i] < i)
    -> Tree with depths, tree_mask, first_child, next_sibling computed from the parents."""
    if draft_tokens.dim() != 2 or parents.shape != draft_tokens.shape:
        raise ValueError(f"draft_tokens and parents must both be [bs, N], got "
                         f"{tuple(draft_tokens.shape)} and {tuple(parents.shape)}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    parents = parents.to(torch.int64).contiguous()
    if not pick_triton(parents, use_triton):
        return tree_from_parents_torch(draft_tokens, parents)
    bs, num_nodes = parents.shape
    depths = torch.empty(bs, num_nodes, dtype=torch.int64, device=parents.device)  # [bs, N]
    tree_mask = torch.empty(bs, num_nodes, num_nodes, dtype=torch.bool,
                            device=parents.device)  # [bs, N, N]
    first_child = torch.empty_like(depths)  # [bs, N]
    next_sibling = torch.empty_like(depths)  # [bs, N]
    triton_module("tree_triton").tree_from_parents_triton(
        parents, depths, tree_mask, first_child, next_sibling)
    return Tree(draft_tokens, parents, depths, tree_mask, first_child, next_sibling)


# ---- chains (topk == 1, STANDALONE drafts) ---------------------------------------------------

def chain_tree(draft_tokens: torch.Tensor) -> Tree:
    """draft_tokens: [bs, N], node 0 = the root, node i = the i-th draft -> the chain's Tree.

    The structure depends on N alone, so it is built with torch in every path (no kernel)."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [bs, N], got {tuple(draft_tokens.shape)}")
    bs, num_nodes = draft_tokens.shape
    device = draft_tokens.device
    nodes = torch.arange(num_nodes, device=device).expand(bs, num_nodes)  # [bs, N]
    first_child = torch.where(nodes + 1 < num_nodes, nodes + 1, -1)
    tree_mask = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device).tril()
    return Tree(draft_tokens, nodes - 1, nodes.clone(), tree_mask.expand(bs, -1, -1).clone(),
                first_child, torch.full_like(nodes, -1))


# ---- EAGLE-style multi-step top-k drafting ---------------------------------------------------

def build_tree(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
               branch_parents: torch.Tensor, num_draft_tokens: int, *,
               use_triton: bool | None = None) -> Tree:
    """Keeps the num_draft_tokens - 1 best-scored draft candidates as a tree under the root.

    With S = num_steps and K = topk, drafting step s expands K branches (step 0: the root only)
    and each branch proposes K candidates:

    - root_tokens: [bs] the last verified token per request (node 0);
    - cand_tokens: [bs, S, K, K] cand_tokens[:, s, b, j] = j-th candidate of branch b at step s;
    - cand_scores: [bs, S, K, K] float, the cumulative log-prob of the path root -> candidate
      (any score where a child never beats its parent works: a log-prob sum, a prob product);
    - branch_parents: [bs, S, K] int, for s >= 1: which candidate of step s-1 branch b of step s
      expands, as the flat index b' * K + j' into step s-1's [K, K] grid (at step 1 that is j',
      since step 0 has branch 0 alone).

    Step 0's branches 1..K-1 and branch_parents[:, 0] are ignored (only the root expands there).
    Requires 1 <= num_draft_tokens <= 1 + K + (S - 1) * K * K.
    Nodes come out in step order, then branch, then candidate: a parent always precedes its
    children. NOTE: ties in score go to the earlier candidate (a stable sort); since a child never
    outscores its parent, every kept node's parent is kept too.
    """
    num_cands = _check_build_inputs(root_tokens, cand_tokens, cand_scores, branch_parents,
                                    num_draft_tokens)
    if pick_triton(cand_scores, use_triton) and num_cands <= MAX_SELECT:
        draft_tokens, parents = triton_module("tree_triton").select_nodes_triton(
            root_tokens, cand_tokens, cand_scores, branch_parents, num_draft_tokens, num_cands)
    else:
        draft_tokens, parents = _select_nodes_torch(root_tokens, cand_tokens, cand_scores,
                                                    branch_parents, num_draft_tokens, num_cands)
    return tree_from_parents(draft_tokens, parents, use_triton=use_triton)


def _select_nodes_torch(root_tokens, cand_tokens, cand_scores, branch_parents,
                        num_draft_tokens: int, num_cands: int) -> tuple:
    """The twin of the selection: (draft_tokens [bs, N], parents [bs, N] int64)."""
    bs = root_tokens.shape[0]
    tokens, scores, cand_parents = _flatten_candidates(cand_tokens, cand_scores, branch_parents)
    num_kept = num_draft_tokens - 1
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_kept]
    kept = best.sort(dim=1).values  # [bs, N - 1] candidate indices in creation order
    node_of_cand = torch.full((bs, num_cands), -1, dtype=torch.int64, device=kept.device)
    node_ids = torch.arange(1, num_kept + 1, device=kept.device).expand(bs, -1)  # [bs, N - 1]
    node_of_cand.scatter_(1, kept, node_ids)
    parent_cand = cand_parents.gather(1, kept)  # [bs, N - 1]; -1 = the root
    parent_node = torch.where(parent_cand >= 0,
                              node_of_cand.gather(1, parent_cand.clamp(min=0)), 0)
    parents = torch.cat([torch.full((bs, 1), -1, dtype=torch.int64, device=kept.device),
                         parent_node], dim=1)  # [bs, N]
    draft_tokens = torch.cat([root_tokens[:, None].to(tokens.dtype), tokens.gather(1, kept)],
                             dim=1)  # [bs, N]
    return draft_tokens, parents


def _check_build_inputs(root_tokens, cand_tokens, cand_scores, branch_parents,
                        num_draft_tokens: int) -> int:
    """Validates shapes; returns the number of real candidates, K + (S - 1) * K * K."""
    if cand_tokens.dim() != 4 or cand_tokens.shape[2] != cand_tokens.shape[3]:
        raise ValueError(f"cand_tokens must be [bs, S, K, K], got {tuple(cand_tokens.shape)}")
    bs, num_steps, topk, _ = cand_tokens.shape
    if cand_scores.shape != cand_tokens.shape:
        raise ValueError(f"cand_scores must be {tuple(cand_tokens.shape)}, "
                         f"got {tuple(cand_scores.shape)}")
    if branch_parents.shape != (bs, num_steps, topk):
        raise ValueError(f"branch_parents must be [{bs}, {num_steps}, {topk}], "
                         f"got {tuple(branch_parents.shape)}")
    if root_tokens.shape != (bs,):
        raise ValueError(f"root_tokens must be [{bs}], got {tuple(root_tokens.shape)}")
    num_cands = topk + (num_steps - 1) * topk * topk
    if not 1 <= num_draft_tokens <= 1 + num_cands:
        raise ValueError(f"num_draft_tokens must be in [1, {1 + num_cands}] for {num_steps} "
                         f"steps of topk {topk}, got {num_draft_tokens}")
    return num_cands


def _flatten_candidates(cand_tokens, cand_scores, branch_parents):
    """-> tokens, scores, parents: [bs, K + (S-1)K^2] each; parents index the same flat list
    (-1 = the root). Flat order: step 0's K candidates, then each later step's [K, K] grid."""
    bs, num_steps, topk, _ = cand_tokens.shape
    grid = topk * topk
    tokens = torch.cat([cand_tokens[:, 0, 0], cand_tokens[:, 1:].reshape(bs, -1)], dim=1)
    scores = torch.cat([cand_scores[:, 0, 0], cand_scores[:, 1:].reshape(bs, -1)], dim=1)
    # Flat offset of step t's first candidate: 0 for t = 0, K + (t - 1) K^2 after. Built on
    # the device (no host-to-device copy), so a CUDA graph can capture the whole selection.
    t = torch.arange(num_steps - 1, dtype=torch.int64, device=cand_tokens.device)
    offsets = torch.where(t == 0, 0, topk + (t - 1) * grid)
    later = branch_parents[:, 1:].to(torch.int64) + offsets[None, :, None]  # [bs, S - 1, K]
    later = later.repeat_interleave(topk, dim=2).reshape(bs, -1)  # one per candidate
    root_children = torch.full((bs, topk), -1, dtype=torch.int64, device=later.device)
    return tokens, scores, torch.cat([root_children, later], dim=1)
