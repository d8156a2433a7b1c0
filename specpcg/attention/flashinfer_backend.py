"""Paged attention through flashinfer's batch wrappers (optional: the `specpcg[flashinfer]` extra).

Our pool is flashinfer's paged layout with page size 1: a slot is a page, so a request's page
list is its `req_to_token` row and every last page holds exactly one token. flashinfer's causal
mask is aligned to the end of the KV row, which is our "query j sees keys 0..prefix + j".

Graph mode for plain decode steps: a captured batch size gets a decode wrapper of its own in
flashinfer's graph mode, over page-table buffers that never move (slices of three shared
buffers), and `init_graph_metadata` plans it before each capture and replay, which copies the
live page table into those buffers. Verifies, prefills and a draft's rounds plan anew for each
batch on the host and run eagerly (`decode_graph_only`). On one H100 (a9a826b) a decode graph
replayed on grown lengths matched the torch reference
(`tests/test_attention.py::test_cuda_graph_decode_replays_live_lengths[flashinfer]`), and an
engine with graphs decoded the default model's shape at 854 / 10,947 tok/s at batch 1 / 16,
against 66 / 1,012 eagerly (Triton with graphs: 1,301 / 16,284; it stays the default).
"""

from __future__ import annotations

import torch

from specpcg.attention.base import AttentionBackend
from specpcg.core import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttnBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True  # decode steps only (graph mode below)
    decode_graph_only = True
    plans_from_rows = True  # _page_table reads req_to_token

    def __init__(self, kv_cache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        import flashinfer  # optional dependency: imported only when this backend is chosen

        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        self._flashinfer = flashinfer
        device = kv_cache.req_pool.req_to_token.device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._active_decode = self._decode
        # Graph mode: every captured batch size's wrapper reads slices of these buffers. A
        # padded batch is at most every request row, its page list at most every slot plus
        # its padding rows' sink pages.
        rows = kv_cache.req_pool.req_to_token.shape[0]
        kw = dict(dtype=torch.int32, device=device)
        self._indptr_buf = torch.zeros(rows + 1, **kw)
        self._last_page_buf = torch.ones(rows, **kw)
        self._indices_buf = torch.zeros(kv_cache.total_slots + 64 * rows, **kw)
        self._graph_decode: dict = {}  # batch size -> its graph-mode decode wrapper
        self._num_real_tokens = 0

    def _graph_wrapper(self, bs: int):
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=self._indptr_buf[:bs + 1],
                paged_kv_indices_buffer=self._indices_buf,
                paged_kv_last_page_len_buffer=self._last_page_buf[:bs])
            self._graph_decode[bs] = wrapper
        return wrapper

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
        self._plan(batch, self._decode)

    def init_graph_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode != ForwardMode.DECODE:
            raise ValueError(f"the flashinfer backend replays plain decode steps only, got "
                             f"forward_mode={batch.forward_mode.name}")
        self._plan(batch, self._graph_wrapper(batch.batch_size))

    def _plan(self, batch: ForwardBatch, decode_wrapper) -> None:
        """Plans the batch's wrapper (decode_wrapper for a DECODE batch)."""
        kv_indptr, kv_indices, last_page_len = self._page_table(batch)
        dtype = self.kv_cache.pool.dtype
        # Head counts, head dim and page size go positionally: their keyword names moved
        # between flashinfer releases (head_dim -> head_dim_qk), their order did not.
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        kwargs = dict(sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
        self._num_real_tokens = int(sum(batch.extend_seq_lens_cpu))
        if batch.forward_mode == ForwardMode.DECODE:
            decode_wrapper.plan(kv_indptr, kv_indices, last_page_len, *shape, **kwargs)
            self._active_decode = decode_wrapper
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
        wrapper = (self._active_decode if batch.forward_mode == ForwardMode.DECODE
                   else self._prefill)
        o = wrapper.run(q3, paged_kv)  # [num_real, H, D]
        if out is None:
            out = torch.zeros_like(q)  # [T, H * D]; padding rows stay zero
        out[:num_real] = o.reshape(num_real, -1).to(q.dtype)
        return out
