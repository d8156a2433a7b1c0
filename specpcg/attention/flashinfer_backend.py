"""Paged attention through flashinfer's batch wrappers (optional: the `specpcg[flashinfer]` extra).

Our pool is flashinfer's paged layout with page size 1: a slot is a page, so a request's page
list is its `req_to_token` row and every last page holds exactly one token. flashinfer's causal
mask is aligned to the end of the KV row, which is our "query j sees keys 0..prefix + j".
"""

from __future__ import annotations

import torch

from specpcg.attention.base import AttentionBackend
from specpcg.core import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttnBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = False  # plan() runs on the host per batch; graph buffers not wired up

    def __init__(self, kv_cache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        import flashinfer  # optional dependency: imported only when this backend is chosen

        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        device = kv_cache.req_pool.req_to_token.device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._num_real_tokens = 0

    def _page_table(self, batch: ForwardBatch):
        """kv_indptr [bs + 1], kv_indices [sum(seq_lens)], last_page_len [bs], all int32."""
        device = self._workspace.device
        req_to_token = self.kv_cache.req_pool.req_to_token
        req_pool_indices_cpu = batch.req_pool_indices.tolist()
        rows = [req_to_token[r, :n] for r, n in zip(req_pool_indices_cpu, batch.seq_lens_cpu)]
        kv_indices = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int32, device=device)
        kv_indptr = torch.tensor([0] + batch.seq_lens_cpu, dtype=torch.int32,
                                 device=device).cumsum(0, dtype=torch.int32)
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32, device=device)
        return kv_indptr, kv_indices.to(torch.int32), last_page_len

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        kv_indptr, kv_indices, last_page_len = self._page_table(batch)
        dtype = self.kv_cache.pool.dtype
        # Head counts, head dim and page size go positionally: their keyword names moved
        # between flashinfer releases (head_dim -> head_dim_qk), their order did not.
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        kwargs = dict(sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
        self._num_real_tokens = int(sum(batch.extend_seq_lens_cpu))
        if batch.forward_mode == ForwardMode.DECODE:
            self._decode.plan(kv_indptr, kv_indices, last_page_len, *shape, **kwargs)
            return
        qo_indptr = torch.tensor([0] + batch.extend_seq_lens_cpu, dtype=torch.int32,
                                 device=kv_indptr.device).cumsum(0, dtype=torch.int32)
        self._prefill.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, *shape,
                           causal=True, **kwargs)

    def attend(self, q, layer_id: int, batch: ForwardBatch, out=None) -> torch.Tensor:
        pool = self.kv_cache.pool
        # [slots, page_size=1, Hkv, D]: the NHD paged layout flashinfer expects
        paged_kv = (pool.k_buffers[layer_id].unsqueeze(1), pool.v_buffers[layer_id].unsqueeze(1))
        num_real = self._num_real_tokens
        q3 = q[:num_real].reshape(num_real, self.num_heads, self.head_dim).to(pool.dtype)
        wrapper = self._decode if batch.forward_mode == ForwardMode.DECODE else self._prefill
        o = wrapper.run(q3, paged_kv)  # [num_real, H, D]
        if out is None:
            out = torch.zeros_like(q)  # [T, H * D]; padding rows stay zero
        out[:num_real] = o.reshape(num_real, -1).to(q.dtype)
        return out
