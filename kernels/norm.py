"""RMSNorm in Triton, plain and fused with the residual add: one program normalises one row.

Numerics follow `specpcg.models.layers.RMSNorm` (and HF): the mean of squares and the scaling
run in fp32, the normalised row is rounded to the stream dtype *before* the weight multiply, and
the product is rounded to the output dtype. The fused variant rounds `x + residual` to the stream
dtype first and normalises that rounded row, exactly what the unfused `h = x + r; norm(h)` does;
the only difference left is the order of the fp32 sum of squares.

Launchers take preallocated outputs and never read tensor values on the host, so they can be
captured in a CUDA graph (after one warm-up call has compiled the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import pdl

MAX_HIDDEN = 8192  # a whole row lives in registers; wider rows would spill


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x_row, stride_residual_row, stride_out_row, stride_residual_out_row,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program: row `row` of x (+ residual), normalised and scaled by the weight. PDL:
    kernels/dispatch.pdl."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size  # BLOCK is hidden_size padded to a power of two
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual_row + offs, mask=mask, other=0.0)
        # NOTE: round the sum to the stream dtype before normalising, as the unfused model does;
        # normalising the fp32 sum instead drifts from HF by one bf16 ulp on some elements.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        # Every element is read before it is written, so residual_out may alias residual or x.
        tl.store(residual_out_ptr + row * stride_residual_out_row + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    # Padded lanes hold 0, so they add nothing to the sum of squares.
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden_size + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out_row + offs, y, mask=mask)


def _launch(x, residual, weight, eps, out, residual_out):
    num_rows, hidden_size = x.shape
    if num_rows == 0:
        return  # nothing to do; shapes are static under capture, so this branch is too
    block = triton.next_power_of_2(hidden_size)
    # ~8 elements per thread keeps a row in registers; 8 warps is enough up to 8192.
    num_warps = min(max(block // 256, 1), 8)
    has_residual = residual is not None
    if not has_residual:
        residual, residual_out = x, out  # unused by the kernel; any valid pointer will do
    _rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        hidden_size, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps, **pdl(x),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor) -> torch.Tensor:
    """x, out: [T, H] with unit stride along H; weight: [H]. Writes and returns out."""
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, out: torch.Tensor,
                              residual_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; out = rmsnorm(residual_out). All [T, H] except weight [H]."""
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
