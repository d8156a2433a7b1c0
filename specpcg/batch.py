"""A forward's batch from the scheduler's requests: the one packed host-to-device copy."""

from __future__ import annotations

import numpy as np
import torch

from specpcg.core import ForwardBatch, ForwardMode
from specpcg.transfer import runs, to_device


def make_batch(kv_cache, mode: ForwardMode, reqs: list, new_ids: list, device,
               rows_pending: bool = False) -> ForwardBatch:
    """Builds the ForwardBatch for `reqs`, whose new tokens (`new_ids[i]`) already have slots
    (with rows_pending, not yet in req_to_token: extend_many(write=False)). Everything goes to
    the device in one packed copy: a decode step is latency-bound."""
    ext_lens = [len(ids) for ids in new_ids]
    seq_lens = [r.num_cached + n for r, n in zip(reqs, ext_lens)]
    flat_ids, slots = [], []
    for r, s, n, ids in zip(reqs, seq_lens, ext_lens, new_ids):
        flat_ids += ids
        slots += kv_cache.slots_of(r.req_pool_idx)[s - n:s]
    num_tokens, bs = len(flat_ids), len(reqs)
    positions = runs([s - n for s, n in zip(seq_lens, ext_lens)], ext_lens)
    # A batch of more tokens than requests (prefill, verify, a draft's catch-up) starts every
    # part 16 bytes in (an even number of int64s): Triton specializes a pointer argument on
    # 16-byte alignment, and a part at an odd offset compiled a second variant of each kernel
    # reading it the first time an odd token count came (a 0.12 s stall inside a speculative
    # step on an H200, benchmarks/probe_jit.py). A decode-shaped batch keeps its parts back to
    # back, the [5, bs] block the graph runner loads with one copy into its own buffers:
    # cutting the padding off each part would add host time to every decode step at odd sizes.
    pad = num_tokens != bs
    pad_t, pad_b = [0] * (pad and num_tokens & 1), [0] * (pad and bs & 1)
    packed = to_device(torch.from_numpy(np.concatenate([
        np.asarray(flat_ids + pad_t, dtype=np.int64), positions,
        np.asarray(pad_t + slots + pad_t + [r.req_pool_idx for r in reqs] + pad_b + seq_lens
                   + pad_b + ext_lens + pad_b, dtype=np.int64)])), device)
    parts = packed.split([num_tokens + len(pad_t)] * 3 + [bs + len(pad_b)] * 3)
    if pad_t or pad_b:  # each part without its padding
        parts = [p[:n] for p, n in zip(parts, [num_tokens] * 3 + [bs] * 3)]
    return ForwardBatch(
        forward_mode=mode, input_ids=parts[0], positions=parts[1], out_cache_loc=parts[2],
        req_pool_indices=parts[3], seq_lens=parts[4], extend_seq_lens=parts[5],
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext_lens, rows_pending=rows_pending,
        index_rows=None if pad else packed[:5 * bs].view(5, bs))


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
