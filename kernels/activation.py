"""SiLU-and-mul in Triton: out = silu(gate) * up for the fused [gate; up] projection's output.

Numerics follow `F.silu(gate) * up` in the input dtype: silu runs in fp32 and is rounded to the
input dtype (what torch's silu does for bf16), then the product runs in fp32 and is rounded again.
The launcher reads no tensor values on the host: capturable in a CUDA graph once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program; a row of I columns takes cdiv(I, BLOCK) programs


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_gate_up_row, stride_out_row, inter_size,
    BLOCK: tl.constexpr,
):
    """One program: BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    gate_row = gate_up_ptr + row * stride_gate_up_row
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
    # NOTE: round silu(gate) to the input dtype before the product, as `F.silu(gate) * up` does.
    # exp(-gate) overflows to inf for very negative gate, giving gate / inf = -0: silu's limit.
    act = (gate / (1.0 + tl.exp(-gate))).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + offs, (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I], out: [T, I], both with unit stride along columns. Returns out."""
    num_rows, inter_size = out.shape
    if num_rows == 0 or inter_size == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter_size))
    grid = (num_rows, triton.cdiv(inter_size, block))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter_size,
                               BLOCK=block, num_warps=4)
    return out
