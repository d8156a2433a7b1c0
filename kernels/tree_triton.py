"""Tree structure from a parent array in Triton: one program per request, all N nodes at once.

The ancestor mask is built by walking every node up to the root in lockstep (N hops at most,
each a gather from the parent array in global memory, which the program only reads); child and
sibling lists are minima over [N, N] comparisons of the parent array with itself. Nothing is
written and read back, so no barrier is needed. The launcher never reads tensor values on the
host, so it can be captured in a CUDA graph (after a warm-up call has compiled the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 128  # the [N, N] tiles live in registers


@triton.jit
def _tree_from_parents_kernel(
    parents_ptr, depths_ptr, tree_mask_ptr, first_child_ptr, next_sibling_ptr,
    num_nodes,
    BLOCK_N: tl.constexpr,
):
    """One program: the depths, mask, first-child and next-sibling lists of request `req`."""
    req = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < num_nodes  # BLOCK_N is N padded to a power of two
    row_ptr = parents_ptr + req * num_nodes
    parents = tl.load(row_ptr + offs, mask=valid, other=-2).to(tl.int32)  # pad: nobody's parent

    # ancestors[i, j]: node j is node i or an ancestor of it. `up[i]` climbs one hop per round.
    ancestors = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.int32)
    up = tl.where(valid, offs, -1)
    for _ in range(0, num_nodes):
        alive = up >= 0
        ancestors = tl.where((offs[None, :] == up[:, None]) & alive[:, None], 1, ancestors)
        up = tl.load(row_ptr + up, mask=alive, other=-1).to(tl.int32)
    depths = tl.sum(ancestors, axis=1) - 1
    tl.store(depths_ptr + req * num_nodes + offs, depths, mask=valid)
    mask_offs = req * num_nodes * num_nodes + offs[:, None] * num_nodes + offs[None, :]
    tl.store(tree_mask_ptr + mask_offs, ancestors != 0, mask=valid[:, None] & valid[None, :])

    # is_child[i, j]: j's parent is i; the smallest such j is i's first child.
    is_child = parents[None, :] == offs[:, None]
    first_child = tl.min(tl.where(is_child, offs[None, :], BLOCK_N), axis=1)
    first_child = tl.where(first_child == BLOCK_N, -1, first_child)
    tl.store(first_child_ptr + req * num_nodes + offs, first_child, mask=valid)

    # later_sibling[i, j]: j > i has i's parent; the root (-1) has no siblings.
    later_sibling = ((parents[None, :] == parents[:, None]) & (offs[None, :] > offs[:, None])
                     & (parents[:, None] >= 0))
    next_sibling = tl.min(tl.where(later_sibling, offs[None, :], BLOCK_N), axis=1)
    next_sibling = tl.where(next_sibling == BLOCK_N, -1, next_sibling)
    tl.store(next_sibling_ptr + req * num_nodes + offs, next_sibling, mask=valid)


def tree_from_parents_triton(parents: torch.Tensor, depths: torch.Tensor,
                             tree_mask: torch.Tensor, first_child: torch.Tensor,
                             next_sibling: torch.Tensor) -> None:
    """parents: [bs, N] int64 contiguous -> writes depths, first_child, next_sibling ([bs, N]
    int64) and tree_mask ([bs, N, N] bool), all contiguous."""
    bs, num_nodes = parents.shape
    if num_nodes > MAX_NODES:
        raise ValueError(f"the Triton tree kernel takes at most {MAX_NODES} nodes, got "
                         f"{num_nodes}; pass use_triton=False for the torch twin")
    if bs == 0:
        return
    block_n = max(triton.next_power_of_2(num_nodes), 16)
    _tree_from_parents_kernel[(bs,)](
        parents, depths, tree_mask, first_child, next_sibling, num_nodes,
        BLOCK_N=block_n, num_warps=4 if block_n <= 64 else 8,
    )


@triton.jit
def _select_kernel(
    root_ptr, tokens_ptr, scores_ptr, branch_parents_ptr, out_tokens_ptr, out_parents_ptr,
    S: tl.constexpr, K: tl.constexpr, NUM_CANDS: tl.constexpr, N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: build_tree's selection for request `req`. Candidate c of the flat list
    (step 0's K, then each later step's [K, K] grid) is ranked by how many candidates beat it
    (a higher score, or the same score earlier: the twin's stable sort); the N - 1 best become
    nodes 1.. in creation order (a cumulative sum), each pointing at its parent's node."""
    req = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    valid = c < NUM_CANDS
    later = c >= K
    step = tl.where(later, 1 + (c - K) // (K * K), 0)
    cell = tl.where(later, (c - K) % (K * K), c)  # [branch, candidate] in the step's grid
    at = req * S * K * K + step * K * K + cell
    score = tl.load(scores_ptr + at, mask=valid, other=float("-inf")).to(tl.float32)
    token = tl.load(tokens_ptr + at, mask=valid, other=0)
    grown = tl.load(branch_parents_ptr + req * S * K + step * K + cell // K,
                    mask=valid & later, other=0).to(tl.int32)
    parent = tl.where(later, grown + tl.where(step == 1, 0, K + (step - 2) * K * K), -1)
    beats = ((score[None, :] > score[:, None])
             | ((score[None, :] == score[:, None]) & (c[None, :] < c[:, None]))) & valid[None, :]
    kept = valid & (tl.sum(beats.to(tl.int32), axis=1) < N - 1)
    node = tl.cumsum(kept.to(tl.int32), axis=0)  # a kept candidate's node id (from 1)
    parent_node = tl.sum(tl.where(c[None, :] == parent[:, None], node[None, :], 0), axis=1)
    parent_node = tl.where(parent >= 0, parent_node, 0)
    out = req * N
    tl.store(out_tokens_ptr + out + node, token, mask=kept)
    tl.store(out_parents_ptr + out + node, parent_node.to(tl.int64), mask=kept)
    tl.store(out_tokens_ptr + out, tl.load(root_ptr + req))
    tl.store(out_parents_ptr + out, tl.full([], -1, tl.int64))


def select_nodes_triton(root_tokens, cand_tokens, cand_scores, branch_parents,
                        num_draft_tokens: int, num_cands: int) -> tuple:
    """build_tree's selection: (draft_tokens [bs, N] of cand_tokens' dtype, parents [bs, N]
    int64). The [C, C] ranks live in registers: num_cands <= kernels.tree.MAX_SELECT."""
    bs, num_steps, topk, _ = cand_tokens.shape
    device = cand_tokens.device
    tokens = torch.empty(bs, num_draft_tokens, dtype=cand_tokens.dtype, device=device)
    parents = torch.empty(bs, num_draft_tokens, dtype=torch.int64, device=device)
    if bs:
        block_c = max(triton.next_power_of_2(num_cands), 16)
        _select_kernel[(bs,)](
            root_tokens, cand_tokens.contiguous(), cand_scores.contiguous(),
            branch_parents.contiguous(), tokens, parents,
            S=num_steps, K=topk, NUM_CANDS=num_cands, N=num_draft_tokens, BLOCK_C=block_c,
            num_warps=4 if block_c <= 64 else 8)
    return tokens, parents
