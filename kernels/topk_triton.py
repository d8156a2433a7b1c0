"""Row-wise top-k (and log-softmax) in Triton: chunks of a row in parallel, then a merge.

`_chunk_kernel`: one program per (row, chunk of BLOCK entries) loads its chunk once and picks
its k best in registers (k rounds of max, lowest index on ties, the pick then masked out); for
log-probabilities it also writes the chunk's max and sum of exp(x - max). The global k best are
among the chunks' k best, so `_merge_kernel` (one program per row) picks k again over chunks * k
candidates by the same rule and, for log-probabilities, subtracts the row's log-sum-exp combined
from the chunks'. A row of one chunk is finished by the first kernel alone. Whichever kernel
finishes a row maps its indices through the index map when there is one. Given a ring write (a
decode graph's greedy pick in an engine with a head: kernels/hidden_ring.py), the first kernel's
programs also copy each row's hidden rows to the ring, a source a chunk, where the write would
take a launch of its own after the pick.

Launchers allocate their scratch and outputs with torch (from the graph's pool under capture)
and never read tensor values on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .hidden_ring_triton import ring_args, ring_row

BLOCK = 2048  # a chunk: 16 fp32 a thread at 4 warps


@triton.jit
def _pick(x, idx, valid, NONE: tl.constexpr):
    """The best valid entry: (value, index), largest value first, lowest index on ties;
    (-inf, NONE) when none is valid."""
    v = tl.max(tl.where(valid, x, float("-inf")), axis=0)
    i = tl.min(tl.where(valid & (x == v), idx, NONE), axis=0)
    return v, i


@triton.jit
def _mapped(map_ptr, i, MAPPED: tl.constexpr):
    """Index i as returned: map[i] with an index map (i is always a valid entry here)."""
    if MAPPED:
        return tl.load(map_ptr + i)
    return i.to(tl.int64)


@triton.jit
def _chunk_kernel(x_ptr, cand_val_ptr, cand_idx_ptr, chunk_max_ptr, chunk_sum_ptr,
                  out_idx_ptr, out_val_ptr, map_ptr, V, num_chunks,
                  src0, src1, src2, stride0, stride1, stride2, pos_ptr, rows_ptr, ring_ptr,
                  K: tl.constexpr, BLOCK: tl.constexpr, LOG_SOFTMAX: tl.constexpr,
                  FINAL: tl.constexpr, NONE: tl.constexpr, MAPPED: tl.constexpr,
                  SOURCES: tl.constexpr, DEPTH: tl.constexpr, H: tl.constexpr,
                  H_BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if SOURCES > 0:  # the row's ring write, its sources spread over the row's chunks
        for source in range(chunk, SOURCES, tl.num_programs(1)):
            ring_row(row, source, src0, src1, src2, stride0, stride1, stride2, pos_ptr,
                     rows_ptr, ring_ptr, SOURCES, DEPTH, H, H_BLOCK)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    x = tl.load(x_ptr + row * V + idx, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = 0.0
    if LOG_SOFTMAX:  # only log-probabilities need the sums
        # Entries at -inf add nothing (a chunk of nothing else would give exp(nan)).
        s = tl.sum(tl.where(valid & (x > float("-inf")), tl.exp(x - m), 0.0), axis=0)
    shift = 0.0
    if FINAL:
        if LOG_SOFTMAX:
            shift = m + tl.log(s)
    slot = (row * num_chunks + chunk) * K
    for j in tl.static_range(K):
        v, i = _pick(x, idx, valid, NONE)
        valid = valid & (idx != i)
        if FINAL:
            tl.store(out_idx_ptr + row * K + j, _mapped(map_ptr, i, MAPPED))
            tl.store(out_val_ptr + row * K + j, v - shift)
        else:
            tl.store(cand_val_ptr + slot + j, v)
            tl.store(cand_idx_ptr + slot + j, i)
    if not FINAL:
        if LOG_SOFTMAX:
            tl.store(chunk_max_ptr + row * num_chunks + chunk, m)
            tl.store(chunk_sum_ptr + row * num_chunks + chunk, s)


@triton.jit
def _merge_kernel(cand_val_ptr, cand_idx_ptr, chunk_max_ptr, chunk_sum_ptr,
                  out_idx_ptr, out_val_ptr, map_ptr, num_chunks,
                  K: tl.constexpr, CANDS: tl.constexpr, CHUNKS: tl.constexpr,
                  LOG_SOFTMAX: tl.constexpr, NONE: tl.constexpr, MAPPED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CANDS)
    live = c < num_chunks * K
    x = tl.load(cand_val_ptr + row * num_chunks * K + c, mask=live, other=float("-inf"))
    idx = tl.load(cand_idx_ptr + row * num_chunks * K + c, mask=live, other=NONE)
    valid = live & (idx != NONE)
    shift = 0.0
    if LOG_SOFTMAX:
        ch = tl.arange(0, CHUNKS)
        m = tl.load(chunk_max_ptr + row * num_chunks + ch, mask=ch < num_chunks,
                    other=float("-inf"))
        s = tl.load(chunk_sum_ptr + row * num_chunks + ch, mask=ch < num_chunks, other=0.0)
        top = tl.max(m, axis=0)
        shift = top + tl.log(tl.sum(tl.where(s > 0, s * tl.exp(m - top), 0.0), axis=0))
    for j in tl.static_range(K):
        v, i = _pick(x, idx, valid, NONE)
        valid = valid & (idx != i)
        tl.store(out_idx_ptr + row * K + j, _mapped(map_ptr, i, MAPPED))
        tl.store(out_val_ptr + row * K + j, v - shift)


def topk_rows_triton(x: torch.Tensor, k: int, log_softmax: bool, index_map=None,
                     ring=None) -> tuple:
    """kernels.topk.topk_rows on the GPU (or the interpreter). ring: (ring, sources, positions,
    pool rows) of kernels.hidden_ring.write_ring, one source row per row of x, written by the
    first kernel's programs (a decode graph's greedy pick: one launch fewer a step)."""
    shape, V = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, V).contiguous()
    n = rows.shape[0]
    out_idx = torch.empty(n, k, dtype=torch.int64, device=x.device)
    out_val = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n == 0:
        return out_idx.view(*shape, k), out_val.view(*shape, k)
    block = min(BLOCK, triton.next_power_of_2(V))
    chunks = triton.cdiv(V, block)
    none = 2 ** 31 - 1  # no entry: larger than any index
    mapped = index_map is not None
    index_map = index_map if mapped else out_idx  # unread without a map: any valid pointer
    ring_ptrs, ring_consts = _ring_launch(ring, out_idx)
    common = dict(K=k, BLOCK=block, LOG_SOFTMAX=log_softmax, NONE=none, **ring_consts)
    if chunks == 1:
        _chunk_kernel[(n, 1)](rows, out_val, out_idx, out_val, out_val, out_idx, out_val,
                              index_map, V, 1, *ring_ptrs, FINAL=True, MAPPED=mapped,
                              **common)
        return out_idx.view(*shape, k), out_val.view(*shape, k)
    cand_val = torch.empty(n, chunks, k, dtype=torch.float32, device=x.device)
    cand_idx = torch.empty(n, chunks, k, dtype=torch.int32, device=x.device)
    # Each chunk's max and sum of exponentials: only log-probabilities read them.
    chunk_max, chunk_sum = ([torch.empty(n, chunks, dtype=torch.float32, device=x.device)
                             for _ in range(2)] if log_softmax else (cand_val, cand_val))
    _chunk_kernel[(n, chunks)](rows, cand_val, cand_idx, chunk_max, chunk_sum, out_idx, out_val,
                               index_map, V, chunks, *ring_ptrs, FINAL=False, MAPPED=False,
                               **common)
    _merge_kernel[(n,)](cand_val, cand_idx, chunk_max, chunk_sum, out_idx, out_val, index_map,
                        chunks, K=k, CANDS=triton.next_power_of_2(chunks * k),
                        CHUNKS=triton.next_power_of_2(chunks), LOG_SOFTMAX=log_softmax,
                        NONE=none, MAPPED=mapped)
    return out_idx.view(*shape, k), out_val.view(*shape, k)


def _ring_launch(ring, anything) -> tuple:
    """The chunk kernel's ring arguments: a write's (ring_args), or unused ones."""
    if ring is None:
        return (anything,) * 3 + (0,) * 3 + (anything,) * 3, dict(SOURCES=0, DEPTH=1, H=1,
                                                                  H_BLOCK=1)
    buf, sources, positions, pool_rows = ring
    pointers, consts = ring_args(buf, sources)
    consts["H_BLOCK"] = consts.pop("BLOCK")
    return (*pointers, positions, pool_rows, buf), consts
