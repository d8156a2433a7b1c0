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
    per_request = [r.req_pool_idx for r in reqs] + seq_lens + ext_lens
    packed = to_device(torch.from_numpy(np.concatenate([
        np.asarray(flat_ids, dtype=np.int64), positions,
        np.asarray(slots + per_request, dtype=np.int64)])), device)
    parts = packed.split([num_tokens] * 3 + [bs] * 3)
    return ForwardBatch(
        forward_mode=mode, input_ids=parts[0], positions=parts[1], out_cache_loc=parts[2],
        req_pool_indices=parts[3], seq_lens=parts[4], extend_seq_lens=parts[5],
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext_lens, rows_pending=rows_pending,
        index_rows=packed[:4 * bs].view(4, bs) if num_tokens == bs else None)
