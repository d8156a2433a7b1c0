"""A row of KV slots per draft-tree node: the attention plan of a tree step or a tree verify.

Node e of request i reads its request's committed prefix, then the tree keys its mask allows, in
key order (a node's ancestors come before it). That is the row a decode query at the node's
position reads once its path is accepted, so the node's attention is that decode's, bit for bit.
(A mask over the tree's own layout puts the same keys at other positions within a block, where a
block's sums can pair them differently.)

The twin builds it with about twenty torch kernels (a gather, a stable sort of the mask, repeats,
a copy of each node's whole req_to_token row and a scatter): an EAGLE3 (5, 4, 8) step plans four
tree steps and a verify this way, about a tenth of its kernels at batch 16 (H200,
benchmarks/results/step_eagle3_bs16_548_c5725e6_h200.txt). The Triton kernel (tree_rows_triton.py)
is one program per node: it copies the prefix, then places each tree key by a cumulative sum of
the mask.

Columns past prefix + K: the twin copies req_to_token's row there, the kernel leaves them as they
were; no attention reads past a node's length, so only columns below prefix + K are specified.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module


def tree_path_rows_torch(req_to_token: torch.Tensor, req_rows: torch.Tensor,
                         seq_lens: torch.Tensor, tree_mask: torch.Tensor, max_len: int,
                         out=None, lens_out=None) -> tuple:
    """The twin of tree_path_rows (same arguments and results)."""
    bs, width, keys = tree_mask.shape
    rows = req_to_token[req_rows.long(), :max_len]  # [bs, L]
    prefix = seq_lens.long() - keys  # [bs]
    cols = prefix[:, None] + torch.arange(keys, device=rows.device)  # [bs, K]
    tree_slots = rows.gather(1, cols).repeat_interleave(width, dim=0)  # [bs * E, K]
    allowed = tree_mask.reshape(bs * width, keys) != 0
    # The allowed keys first, in key order (a stable sort of "not allowed").
    order = torch.sort((~allowed).to(torch.int8), dim=1, stable=True).indices
    node_of = torch.arange(bs, device=rows.device).repeat_interleave(width)  # [bs * E]
    node_rows = torch.index_select(rows, 0, node_of, out=out)  # [bs * E, L]
    node_rows.scatter_(1, cols.repeat_interleave(width, dim=0), tree_slots.gather(1, order))
    lens = (prefix.repeat_interleave(width) + allowed.sum(1)).to(torch.int32)
    return node_rows, lens if lens_out is None else lens_out.copy_(lens)


def tree_path_rows(req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                   tree_mask: torch.Tensor, max_len: int, out=None, lens_out=None,
                   use_triton: bool | None = None) -> tuple:
    """req_to_token [R, L]; req_rows, seq_lens [bs] (seq_lens count the K tree keys, the last of
    each row); tree_mask [bs, E, K]; max_len >= every seq_len; out: a [bs * E, max_len] tensor of
    req_to_token's dtype the rows are written into (a buffer a graph reads); lens_out: a
    [bs * E] int32 tensor the lengths are written into. Returns (rows
    [bs * E, max_len], lens [bs * E] int32): node e of request i is row i * E + e, its first
    lens entries the slots it attends over. Never reads tensor values on the host."""
    if tree_mask.dim() != 3:
        raise ValueError(f"tree_mask must be [bs, E, K], got shape {tuple(tree_mask.shape)}")
    if not pick_triton(req_to_token, use_triton):
        return tree_path_rows_torch(req_to_token, req_rows, seq_lens, tree_mask, max_len, out,
                                    lens_out)
    return triton_module("tree_rows_triton").tree_path_rows_triton(
        req_to_token, req_rows, seq_lens, tree_mask, max_len, out, lens_out)
