"""write_ring in Triton (kernels/hidden_ring.py): one program per row and source copies the
source's row into its part of the ring's entry. `ring_row` is that copy for a kernel that runs
anyway: the greedy pick's (kernels/topk_triton.py) takes it where a decode graph would launch
this one after it. The launchers never read tensor values on the host (CUDA-graph safe)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ring_row(i, s, src0, src1, src2, stride0, stride1, stride2, pos_ptr, rows_ptr, ring_ptr,
             SOURCES: tl.constexpr, DEPTH: tl.constexpr, H: tl.constexpr,
             BLOCK: tl.constexpr):
    """Row i of source s to ring[rows[i], pos[i] % DEPTH, s * H:(s + 1) * H]."""
    pos = tl.load(pos_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    dst = ring_ptr + (row * DEPTH + pos % DEPTH) * (SOURCES * H) + s * H
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


@triton.jit(do_not_specialize=["stride0", "stride1", "stride2"])
def _write_ring_kernel(src0, src1, src2, stride0, stride1, stride2, pos_ptr, rows_ptr,
                       ring_ptr, SOURCES: tl.constexpr, DEPTH: tl.constexpr, H: tl.constexpr,
                       BLOCK: tl.constexpr):
    ring_row(tl.program_id(0).to(tl.int64), tl.program_id(1), src0, src1, src2, stride0,
             stride1, stride2, pos_ptr, rows_ptr, ring_ptr, SOURCES, DEPTH, H, BLOCK)


def ring_args(ring, sources: list) -> tuple:
    """(pointers and strides, constexprs) of a ring write, for _write_ring_kernel or a kernel
    that calls ring_row: three sources' pointers and strides (unused ones repeat the first)."""
    if ring.stride(-1) != 1 or not ring.is_contiguous() or any(s.stride(-1) != 1
                                                               for s in sources):
        raise ValueError("the ring and its sources need unit stride along a row")
    h = sources[0].shape[1]
    padded = list(sources) + [sources[0]] * (3 - len(sources))  # unused pointers
    return ((*padded, *(s.stride(0) for s in padded)),
            dict(SOURCES=len(sources), DEPTH=ring.shape[1], H=h,
                 BLOCK=min(triton.next_power_of_2(h), 1024)))


def write_ring_triton(ring, sources: list, positions, pool_rows) -> None:
    n = sources[0].shape[0]
    if n == 0:
        return
    pointers, consts = ring_args(ring, sources)
    _write_ring_kernel[(n, len(sources))](*pointers, positions, pool_rows, ring, **consts,
                                          num_warps=4)
