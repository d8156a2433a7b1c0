"""write_ring in Triton (kernels/hidden_ring.py): one program per row and source copies the
source's row into its part of the ring's entry. The launcher never reads tensor values on the
host (CUDA-graph safe)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride0", "stride1", "stride2"])
def _write_ring_kernel(src0, src1, src2, stride0, stride1, stride2, pos_ptr, rows_ptr,
                       ring_ptr, DEPTH: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    dst = ring_ptr + (row * DEPTH + pos % DEPTH) * (tl.num_programs(1) * H) + s * H
    if s == 0:
        src = src0 + i * stride0
    elif s == 1:
        src = src1 + i * stride1
    else:
        src = src2 + i * stride2
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < H
        tl.store(dst + cols, tl.load(src + cols, mask=keep), mask=keep)


def write_ring_triton(ring, sources: list, positions, pool_rows) -> None:
    n, h = sources[0].shape
    if n == 0:
        return
    if ring.stride(-1) != 1 or not ring.is_contiguous() or any(s.stride(-1) != 1
                                                               for s in sources):
        raise ValueError("the ring and its sources need unit stride along a row")
    padded = list(sources) + [sources[0]] * (3 - len(sources))  # unused pointers
    _write_ring_kernel[(n, len(sources))](
        *padded, *(s.stride(0) for s in padded), positions, pool_rows, ring,
        DEPTH=ring.shape[1], H=h, BLOCK=min(triton.next_power_of_2(h), 1024), num_warps=4)
