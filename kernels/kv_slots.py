"""KV slots after verification: put the accepted path's slots in place, report the rejected ones.

Before the TARGET_VERIFY forward, a request has `prefix_len` committed tokens whose KV is in the
cache, at `req_to_token[req, 0:prefix_len]`. The root (node 0, the last verified token) sits at
position prefix_len, and the verify forward writes node i's KV into slot `draft_slots[b, i]`
(node i's position is prefix_len + depth(i)). After acceptance the path root -> accepted drafts
must read as positions prefix_len .. prefix_len + accept_len of the sequence, so

    req_to_token[req_pool_indices[b], prefix_len[b] + d] = draft_slots[b, accept_index[b, d]]
    for d in 0 .. accept_len[b]   (the root and the accepted drafts: accept_len + 1 entries)

Slots are indices, so no KV data moves: each accepted node's KV already sits in its slot, it just
becomes the slot of its path position. `rejected_mask[b, i]` is True for every node off the
path; the caller frees `draft_slots[rejected_mask]` (or reuses them next round). Entries of
req_to_token past prefix_len + accept_len are left as they were. For a chain, accept_index is
0, 1, .., accept_len, so the first accept_len + 1 slots are kept in order.

`draft_slots` may be a view of `req_to_token` (the verify's slots read in place): along a path
node indices grow, accept_index[b, d] >= d, so position d is only overwritten after every read
of it. The bonus token's KV is computed next round, as the new root.
NOTE: prefix_len + accept_len < C is the caller's invariant (the verify forward already wrote
those positions); the kernel does not check it, as that would read lengths on the host.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module


def assign_accepted_slots_torch(req_to_token, req_pool_indices, prefix_lens, draft_slots,
                                accept_index, accept_len) -> torch.Tensor:
    """The twin: gather the path's slots, then scatter them into the rows (in place)."""
    bs, num_nodes = draft_slots.shape
    steps = torch.arange(accept_index.shape[1], device=accept_index.device)  # path step d
    on_path = (steps[None, :] <= accept_len[:, None]) & (accept_index >= 0)  # [bs, W]
    nodes = torch.where(on_path, accept_index, 0)  # node 0 is always on the path
    slots = draft_slots.gather(1, nodes)  # [bs, W], read before any write (aliasing)
    rows = req_pool_indices[:, None].expand_as(nodes)
    cols = prefix_lens[:, None] + steps[None, :]
    req_to_token[rows[on_path], cols[on_path]] = slots[on_path].to(req_to_token.dtype)
    rejected_mask = torch.ones(bs, num_nodes, dtype=torch.bool, device=draft_slots.device)
    return rejected_mask.scatter(1, nodes, False)  # [bs, N]


def _check_slot_inputs(req_to_token, req_pool_indices, prefix_lens, draft_slots, accept_index,
                       accept_len) -> None:
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError(f"req_to_token must be [R, C] int32, got {tuple(req_to_token.shape)} "
                         f"{req_to_token.dtype}")
    if draft_slots.dim() != 2:
        raise ValueError(f"draft_slots must be [bs, N], got {tuple(draft_slots.shape)}")
    bs, num_nodes = draft_slots.shape
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("accept_len", accept_len)):
        if t.shape != (bs,):
            raise ValueError(f"{name} must be [{bs}], got {tuple(t.shape)}")
    if accept_index.dim() != 2 or accept_index.shape[0] != bs or accept_index.shape[1] > num_nodes:
        raise ValueError(f"accept_index must be [{bs}, W <= {num_nodes}], "
                         f"got {tuple(accept_index.shape)}")


def assign_accepted_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          prefix_lens: torch.Tensor, draft_slots: torch.Tensor,
                          accept_index: torch.Tensor, accept_len: torch.Tensor, *,
                          use_triton: bool | None = None) -> torch.Tensor:
    """req_to_token: [R, C] int32, updated in place; req_pool_indices, prefix_lens, accept_len:
    [bs] ints; draft_slots: [bs, N] ints; accept_index: [bs, W] (verify.VerifyResult's, W <= N)
    -> rejected_mask: [bs, N] bool, True where node i's slot is no longer used."""
    _check_slot_inputs(req_to_token, req_pool_indices, prefix_lens, draft_slots, accept_index,
                       accept_len)
    accept_index, accept_len = accept_index.to(torch.int64), accept_len.to(torch.int64)
    req_pool_indices, prefix_lens = req_pool_indices.to(torch.int64), prefix_lens.to(torch.int64)
    if not pick_triton(draft_slots, use_triton):
        return assign_accepted_slots_torch(req_to_token, req_pool_indices, prefix_lens,
                                           draft_slots, accept_index, accept_len)
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have unit stride along its columns")
    rejected_mask = torch.empty(draft_slots.shape, dtype=torch.bool,
                                device=draft_slots.device)  # [bs, N]
    triton_module("kv_slots_triton").assign_accepted_slots_triton(
        req_to_token, req_pool_indices.contiguous(), prefix_lens.contiguous(),
        draft_slots if draft_slots.stride(1) == 1 else draft_slots.contiguous(),
        accept_index.contiguous(), accept_len.contiguous(), rejected_mask)
    return rejected_mask
