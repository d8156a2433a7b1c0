"""tree_path_rows in Triton (kernels/tree_rows.py): one program per tree node.

A node's program copies its request's prefix from req_to_token in blocks, then writes the K tree
keys at once: an allowed key goes to prefix + (allowed keys before it), a masked one after every
allowed key, in key order too (the twin's stable sort), and the node's length is prefix + the
allowed count. The launcher never reads tensor values on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # prefix slots a loop iteration copies


@triton.jit
def _tree_rows_kernel(
    r2t_ptr, req_rows_ptr, seq_lens_ptr, mask_ptr, out_ptr, lens_ptr,
    stride_r2t, stride_out, stride_mb, stride_me, stride_mk,
    E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
):
    node = tl.program_id(0)
    i, e = node // E, node % E
    src = r2t_ptr + tl.load(req_rows_ptr + i).to(tl.int64) * stride_r2t
    dst = out_ptr + node.to(tl.int64) * stride_out
    prefix = tl.load(seq_lens_ptr + i).to(tl.int32) - K
    for start in range(0, prefix, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < prefix
        tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)
    k = tl.arange(0, BLOCK_K)
    real = k < K
    flags = tl.load(mask_ptr + i * stride_mb + e * stride_me + k * stride_mk, mask=real, other=0)
    allowed = ((flags != 0) & real).to(tl.int32)
    masked = ((flags == 0) & real).to(tl.int32)
    num_allowed = tl.sum(allowed, axis=0)
    col = tl.where(allowed != 0, tl.cumsum(allowed, axis=0) - 1,
                   num_allowed + tl.cumsum(masked, axis=0) - 1)
    slots = tl.load(src + prefix + k, mask=real)
    tl.store(dst + prefix + col, slots, mask=real)
    tl.store(lens_ptr + node, prefix + num_allowed)


def tree_path_rows_triton(req_to_token, req_rows, seq_lens, tree_mask, max_len: int, out=None,
                          lens_out=None):
    bs, width, keys = tree_mask.shape
    if out is None:
        out = torch.empty(bs * width, max_len, dtype=req_to_token.dtype,
                          device=req_to_token.device)
    lens = lens_out
    if lens is None:
        lens = torch.empty(bs * width, dtype=torch.int32, device=req_to_token.device)
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    if bs * width:
        _tree_rows_kernel[(bs * width,)](
            req_to_token, req_rows, seq_lens, mask, out, lens,
            req_to_token.stride(0), out.stride(0), *mask.stride(),
            E=width, K=keys, BLOCK_K=triton.next_power_of_2(max(keys, 2)), BLOCK=BLOCK,
            num_warps=1)
    return out, lens
