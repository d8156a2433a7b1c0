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
