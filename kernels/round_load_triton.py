"""load_round in Triton (kernels/round_load.py): one program per request writes its path's
columns, its segments and its chain slots. The launcher never reads tensor values on the host
(CUDA-graph safe)."""

from __future__ import annotations

import triton
import triton.language as tl


# Triton specializes integer arguments on == 1 and on divisibility by 16, so each new batch
# size class (1; 16, 32, 64; the rest) compiled a variant of this copy inside a serving step:
# 78 ms within a timed batch of 4 on an H200 (STANDALONE, benchmarks/probe_jit.py, d14091e).
# A copy gains nothing from the specialization: one variant serves every size.
@triton.jit(do_not_specialize=["stride_ids", "stride_r2t", "n", "W", "STEPS"])
def _load_round_kernel(rows_ptr, first_ptr, lens_ptr, roots_ptr, ids_ptr, r2t_ptr, out_ptr,
                       stride_ids, stride_r2t, n, W, STEPS, SINK: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    first = tl.load(first_ptr + i).to(tl.int64)
    length = tl.load(lens_ptr + i).to(tl.int64)
    row = r2t_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_r2t
    valid = cols < W
    real = valid & (cols < length)
    pos = tl.where(real, first + cols, 0)
    slots = tl.where(real, tl.load(row + pos, mask=real, other=0).to(tl.int64), SINK)
    ids = tl.where(real, tl.load(ids_ptr + i * stride_ids + cols, mask=real, other=0), 0)
    tl.store(out_ptr + i * W + cols, ids.to(tl.int64), mask=valid)
    tl.store(out_ptr + (n + i) * W + cols, pos, mask=valid)
    tl.store(out_ptr + (2 * n + i) * W + cols, slots, mask=valid)
    seg = out_ptr + 3 * n * W + i
    tl.store(seg, tl.load(rows_ptr + i).to(tl.int64))
    tl.store(seg + n, first + length)
    tl.store(seg + 2 * n, length)
    tl.store(seg + 3 * n, i)
    tl.store(seg + 4 * n, tl.load(roots_ptr + i).to(tl.int64))
    j = tl.arange(0, BLOCK_S)
    chain = j < STEPS
    step_slots = tl.load(row + first + length + j, mask=chain, other=0).to(tl.int64)
    tl.store(seg + 5 * n + j * n, step_slots, mask=chain)


def load_round_triton(rows, first_pos, lens, roots, ids, req_to_token, steps: int, sink: int,
                      out) -> None:
    n, w = ids.shape
    if n == 0:
        return
    if ids.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("ids and req_to_token need unit stride along a row")
    _load_round_kernel[(n,)](
        rows, first_pos, lens, roots, ids, req_to_token, out, ids.stride(0),
        req_to_token.stride(0), n, w, steps, SINK=sink,
        BLOCK_W=triton.next_power_of_2(max(w, 2)), BLOCK_S=triton.next_power_of_2(max(steps, 2)),
        num_warps=1)
