"""A forward's batch from the scheduler's requests: the one packed host-to-device copy."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from specpcg.core import ForwardBatch, ForwardMode
from specpcg.transfer import runs, to_device


def make_batch(kv_cache, mode: ForwardMode, reqs: list, new_ids: list, device,
               rows_pending: bool = False) -> ForwardBatch:
    """Builds the ForwardBatch for `reqs`, whose new tokens (`new_ids[i]`) already have slots
    (with rows_pending, not yet in req_to_token: extend_many(write=False)). Everything goes to
    the device in one packed copy: a decode step is latency-bound."""
    if all(len(ids) == 1 for ids in new_ids):
        return _one_token_batch(kv_cache, mode, reqs, new_ids, device, rows_pending)
    ext_lens = [len(ids) for ids in new_ids]
    seq_lens = [r.num_cached + n for r, n in zip(reqs, ext_lens)]
    num_tokens, bs = sum(ext_lens), len(reqs)
    # A batch of more tokens than requests (prefill, verify, a draft's catch-up) starts every
    # part 16 bytes in (an even number of int64s): Triton specializes a pointer argument on
    # 16-byte alignment, and a part at an odd offset compiled a second variant of each kernel
    # reading it the first time an odd token count came (a 0.12 s stall inside a speculative
    # step on an H200, benchmarks/probe_jit.py). A one-token batch keeps its parts back to back
    # (`_one_token_batch`): cutting the padding off each part would add host time to every
    # decode step at odd sizes.
    pad = num_tokens != bs
    t = num_tokens + (pad and num_tokens & 1)
    b = bs + (pad and bs & 1)
    host = np.zeros(3 * t + 3 * b, dtype=np.int64)
    # NOTE: numpy reads the ids and slots straight from the requests' lists: joining them into
    # one list first took twice as long (a draft's catch-up at batch 64 x 250 positions: about
    # 16,000 of each).
    host[:num_tokens] = np.fromiter(itertools.chain.from_iterable(new_ids), np.int64,
                                    num_tokens)
    host[t:t + num_tokens] = runs([s - n for s, n in zip(seq_lens, ext_lens)], ext_lens)
    host[2 * t:2 * t + num_tokens] = np.fromiter(itertools.chain.from_iterable(
        kv_cache.slots_of(r.req_pool_idx)[s - n:s]
        for r, s, n in zip(reqs, seq_lens, ext_lens)), np.int64, num_tokens)
    host[3 * t:].reshape(3, b)[:, :bs] = [[r.req_pool_idx for r in reqs], seq_lens, ext_lens]
    packed = to_device(torch.from_numpy(host), device)
    parts = packed.split([t] * 3 + [b] * 3)
    if t != num_tokens or b != bs:  # each part without its padding
        parts = [p[:n] for p, n in zip(parts, [num_tokens] * 3 + [bs] * 3)]
    return ForwardBatch(
        forward_mode=mode, input_ids=parts[0], positions=parts[1], out_cache_loc=parts[2],
        req_pool_indices=parts[3], seq_lens=parts[4], extend_seq_lens=parts[5],
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext_lens, rows_pending=rows_pending)


def _one_token_batch(kv_cache, mode: ForwardMode, reqs: list, new_ids: list, device,
                     rows_pending: bool) -> ForwardBatch:
    """make_batch of one new token a request (a decode step): its six parts are the rows of one
    [6, bs] block, built in one list. NOTE: on an H200 a batch-1 decode step's host work sets
    its pace, and each Python-level op on its tensors costs the host a few microseconds."""
    bs = len(reqs)
    cached = [r.num_cached for r in reqs]
    rows = [r.req_pool_idx for r in reqs]
    seq_lens = [c + 1 for c in cached]
    slots = [kv_cache.slots_of(i)[c] for i, c in zip(rows, cached)]
    block = to_device(torch.from_numpy(np.array(
        [ids[0] for ids in new_ids] + cached + slots + rows + seq_lens + [1] * bs,
        dtype=np.int64)), device).view(6, bs)
    # The graph runner loads the first five rows with one copy into its own buffers.
    ids, positions, out_cache_loc, pool_rows, lens, ext = block.unbind(0)
    return ForwardBatch(
        forward_mode=mode, input_ids=ids, positions=positions, out_cache_loc=out_cache_loc,
        req_pool_indices=pool_rows, seq_lens=lens, extend_seq_lens=ext, seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=[1] * bs, rows_pending=rows_pending, index_rows=block[:5])


def alloc_batch(kv_cache, mode: ForwardMode, reqs: list, new_ids: list, device,
                rows_pending: bool = True) -> ForwardBatch:
    """Slots for each request's new tokens, and their batch. With rows_pending the req_to_token
    rows are left to the forward (the runner writes them from the batch's device tensors, at
    the batch's positions): that spares the host a second packing and copy of every slot (a
    draft's catch-up after 94 plain steps at batch 64 covers about 6,000 positions). A caller
    that moves the positions after (a tree step: its branches share one) writes them here."""
    kv_cache.extend_many([r.req_pool_idx for r in reqs], [len(ids) for ids in new_ids],
                         write=not rows_pending)
    return make_batch(kv_cache, mode, reqs, new_ids, device, rows_pending=rows_pending)
