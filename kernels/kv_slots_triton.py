"""Accepted-path KV slots in Triton: one program per request rewrites its req_to_token entries.

All of a request's path slots are loaded before any is stored (a barrier between), so
`draft_slots` may alias `req_to_token`. The launcher never reads tensor values on the host, so
it can be captured in a CUDA graph (after a warm-up call has compiled the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _assign_accepted_slots_kernel(
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, draft_slots_ptr,
    accept_index_ptr, accept_len_ptr, rejected_ptr,
    stride_req_row, stride_slots_row, num_nodes, accept_width,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: request `req`'s path slots into its req_to_token row; its rejected nodes."""
    req = tl.program_id(0).to(tl.int64)
    steps = tl.arange(0, BLOCK_W)  # path step d: the root is d = 0
    accept_len = tl.load(accept_len_ptr + req)
    on_path = (steps <= accept_len) & (steps < accept_width)
    nodes = tl.load(accept_index_ptr + req * accept_width + steps, mask=on_path, other=-1)
    on_path = on_path & (nodes >= 0)
    slots = tl.load(draft_slots_ptr + req * stride_slots_row + nodes, mask=on_path, other=0)
    # NOTE: every read above must land before any write below when draft_slots aliases the row.
    tl.debug_barrier()
    pool_row = tl.load(req_pool_indices_ptr + req)
    prefix_len = tl.load(prefix_lens_ptr + req)
    dst_ptr = req_to_token_ptr + pool_row * stride_req_row + prefix_len + steps
    tl.store(dst_ptr, slots.to(tl.int32), mask=on_path)

    node_ids = tl.arange(0, BLOCK_N)
    is_kept = (nodes[None, :] == node_ids[:, None]) & on_path[None, :]  # [BLOCK_N, BLOCK_W]
    kept = tl.max(is_kept.to(tl.int32), axis=1)
    tl.store(rejected_ptr + req * num_nodes + node_ids, kept == 0, mask=node_ids < num_nodes)


def assign_accepted_slots_triton(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 prefix_lens: torch.Tensor, draft_slots: torch.Tensor,
                                 accept_index: torch.Tensor, accept_len: torch.Tensor,
                                 rejected_mask: torch.Tensor) -> None:
    """req_to_token [R, C] int32 (unit column stride), updated in place; draft_slots [bs, N]
    (unit column stride); accept_index [bs, W], accept_len, req_pool_indices, prefix_lens [bs]
    int64 contiguous; writes rejected_mask [bs, N] bool contiguous."""
    bs, num_nodes = draft_slots.shape
    if bs == 0:
        return
    accept_width = accept_index.shape[1]
    _assign_accepted_slots_kernel[(bs,)](
        req_to_token, req_pool_indices, prefix_lens, draft_slots,
        accept_index, accept_len, rejected_mask,
        req_to_token.stride(0), draft_slots.stride(0), num_nodes, accept_width,
        BLOCK_W=max(triton.next_power_of_2(accept_width), 16),
        BLOCK_N=max(triton.next_power_of_2(num_nodes), 16),
        num_warps=1,
    )
