"""Reference attention in plain torch: one SDPA call per request. Runs on CPU and GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpcg.attention.base import AttentionBackend
from specpcg.core import ForwardBatch


class TorchAttnBackend(AttentionBackend):
    name = "torch"
    supports_row_stride = True
    supports_tree_mask = True

    def attend(self, q, layer_id: int, batch: ForwardBatch, out=None) -> torch.Tensor:
        pool = self.kv_cache.pool
        req_to_token = self.kv_cache.req_pool.req_to_token
        if out is None:
            out = torch.zeros_like(q)  # rows past the real tokens (graph padding) stay zero
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (seq_len, ext_len) in enumerate(zip(batch.seq_lens_cpu, batch.extend_seq_lens_cpu)):
            prefix_len = seq_len - ext_len
            slots = req_to_token[batch.req_pool_indices[i], :seq_len].long()
            keys = pool.k_buffers[layer_id][slots].to(q.dtype)  # [seq_len, Hkv, D]
            values = pool.v_buffers[layer_id][slots].to(q.dtype)
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            queries = q[start:start + ext_len].view(ext_len, self.num_heads, self.head_dim)
            if batch.tree_mask is not None:
                mask = _tree_mask(batch.tree_mask[i], seq_len)
            else:
                mask = _causal_mask(ext_len, seq_len, q.device)
            o = F.scaled_dot_product_attention(
                queries.transpose(0, 1), keys, values, attn_mask=mask,
                is_causal=mask is None and prefix_len == 0 and ext_len > 1, scale=self.scale)
            out[start:start + ext_len] = o.transpose(0, 1).reshape(ext_len, -1)
            start += batch.req_row_stride or ext_len
        return out


def _causal_mask(ext_len: int, seq_len: int, device):
    """None where SDPA needs no mask (a fresh prompt uses is_causal, one query sees all keys)."""
    prefix_len = seq_len - ext_len
    if ext_len == 1 or prefix_len == 0:
        return None
    q_pos = torch.arange(ext_len, device=device)[:, None] + prefix_len
    return torch.arange(seq_len, device=device)[None, :] <= q_pos  # [ext, seq_len]


def _tree_mask(tree_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A draft tree's nodes see the whole committed prefix, then only their ancestors.

    tree_mask: [N, K] over the request's last K keys (the tree so far, these N nodes last)."""
    num_nodes, tail = tree_mask.shape
    prefix = torch.ones(num_nodes, seq_len - tail, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask], dim=1)  # [N, seq_len]
