"""Greedy tree verification in Triton: one program per request walks the tree with scalars.

The sibling loop is bounded by N instead of being a `while child != -1`: a malformed sibling
list then ends the walk instead of hanging the GPU. The launcher never reads tensor values on
the host, so it can be captured in a CUDA graph (after a warm-up call has compiled the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_greedy_kernel(
    tokens_ptr, first_child_ptr, next_sibling_ptr, predict_ptr,
    accept_index_ptr, accept_len_ptr, bonus_ptr,
    num_nodes, max_depth,
):
    """One program: the accepted path of request `req`, -1 in accept_index past it."""
    req = tl.program_id(0).to(tl.int64)
    row = req * num_nodes  # this request's nodes in every [bs, N] tensor
    accept_row_ptr = accept_index_ptr + req * (max_depth + 1)
    tl.store(accept_row_ptr, 0)  # the root is always on the path
    cur = 0
    num_accepted = 0
    searching = 1  # 0 once a level had no matching child
    for depth in range(1, max_depth + 1):
        wanted = tl.load(predict_ptr + row + cur)
        child = tl.load(first_child_ptr + row + cur).to(tl.int32)
        child = tl.where(searching != 0, child, -1)
        found = -1
        for _ in range(0, num_nodes):
            if (child >= 0) & (found < 0):
                if tl.load(tokens_ptr + row + child) == wanted:
                    found = child
                else:
                    child = tl.load(next_sibling_ptr + row + child).to(tl.int32)
        # Every column is written (-1 past the path): accept_index needs no fill first.
        tl.store(accept_row_ptr + depth, found.to(tl.int64))
        if found >= 0:
            cur = found
            num_accepted += 1
        else:
            searching = 0
    tl.store(accept_len_ptr + req, num_accepted.to(tl.int64))
    tl.store(bonus_ptr + req, tl.load(predict_ptr + row + cur))


def verify_greedy_triton(draft_tokens: torch.Tensor, first_child: torch.Tensor,
                         next_sibling: torch.Tensor, target_predict: torch.Tensor,
                         accept_index: torch.Tensor, accept_len: torch.Tensor,
                         bonus: torch.Tensor) -> None:
    """Inputs [bs, N] contiguous (first_child, next_sibling int64); writes accept_index
    [bs, max_depth + 1] int64 (every column), accept_len [bs] int64 and bonus [bs]
    (target_predict's dtype)."""
    bs, num_nodes = draft_tokens.shape
    if bs == 0:
        return
    _verify_greedy_kernel[(bs,)](
        draft_tokens, first_child, next_sibling, target_predict,
        accept_index, accept_len, bonus,
        num_nodes, accept_index.shape[1] - 1,
        num_warps=1,
    )
