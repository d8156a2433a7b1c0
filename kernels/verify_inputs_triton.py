"""verify_inputs in Triton (kernels/verify_inputs.py): one program per request, which reads its
last verify's start, length and row, and writes its start, its nodes' positions and slots, and
its key count. The launcher never reads tensor values on the host (CUDA-graph safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.verify_inputs import VerifyInputs


@triton.jit
def _verify_inputs_kernel(first_ptr, lens_ptr, live_ptr, rows_ptr, r2t_ptr, prefix_ptr, pos_ptr,
                          loc_ptr, seq_ptr, stride_r2t, N, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(first_ptr + i).to(tl.int64) + tl.load(lens_ptr + i).to(tl.int64)
    prefix = tl.where(tl.load(live_ptr + i) != 0, start, 0)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    row = r2t_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_r2t
    slots = tl.load(row + prefix + cols, mask=valid, other=0).to(tl.int64)
    tl.store(prefix_ptr + i, prefix)
    tl.store(seq_ptr + i, prefix + N)
    tl.store(pos_ptr + i * N + cols, prefix + cols, mask=valid)
    tl.store(loc_ptr + i * N + cols, slots, mask=valid)


def verify_inputs_triton(first_pos, lens, live, rows, req_to_token, n: int) -> VerifyInputs:
    bs = first_pos.shape[0]
    z = dict(dtype=torch.long, device=first_pos.device)
    out = VerifyInputs(torch.empty(bs, **z), torch.empty(bs * n, **z), torch.empty(bs * n, **z),
                       torch.empty(bs, **z))
    if bs:
        _verify_inputs_kernel[(bs,)](first_pos, lens, live, rows, req_to_token, *out,
                                     req_to_token.stride(0), n,
                                     BLOCK=triton.next_power_of_2(max(n, 2)))
    return out
