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
    per_request = [[r.req_pool_idx for r in reqs], seq_lens, ext_lens]
    # Every part starts 16 bytes in (an even number of int64s): Triton specializes a pointer
    # argument on 16-byte alignment, so a part at an odd offset compiled a second variant of
    # each kernel reading it the first time a batch of an odd token count came (a 0.12 s stall
    # inside a speculative step on an H200, benchmarks/probe_jit.py).
    t_pad, b_pad = num_tokens + (num_tokens & 1), bs + (bs & 1)
    host = np.zeros(3 * t_pad + 3 * b_pad, dtype=np.int64)
    for i, part in enumerate((flat_ids, positions, slots)):
        host[i * t_pad:i * t_pad + num_tokens] = part
    for i, part in enumerate(per_request):
        start = 3 * t_pad + i * b_pad
        host[start:start + bs] = part
    packed = to_device(torch.from_numpy(host), device)
    tokens = packed[:3 * t_pad].view(3, t_pad)[:, :num_tokens]
    rows = packed[3 * t_pad:].view(3, b_pad)[:, :bs]
    return ForwardBatch(
        forward_mode=mode, input_ids=tokens[0], positions=tokens[1], out_cache_loc=tokens[2],
        req_pool_indices=rows[0], seq_lens=rows[1], extend_seq_lens=rows[2],
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext_lens, rows_pending=rows_pending,
        # A decode's ids, positions, slots and request rows in one [4, bs] view (the graph
        # runner loads them with one copy): there t_pad == b_pad.
        index_rows=packed[:4 * t_pad].view(4, t_pad)[:, :bs] if num_tokens == bs else None)
