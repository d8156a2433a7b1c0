"""The attention backend interface every backend implements.

A backend computes paged attention for the forward in flight: it writes the new tokens' K/V to
their slots (`out_cache_loc`), then attends each request's new queries over that request's whole
KV row (`req_to_token[req, :seq_len]`), causally (query j of a request with prefix P sees keys
0..P+j). Metadata comes from `init_forward_metadata`, planned eagerly from the live batch.
"""

from __future__ import annotations

import torch

from specpcg.core import ForwardBatch
from specpcg.kv_cache import KVCache


class AttentionBackend:
    name = "base"
    supports_cuda_graph = False
    supports_row_stride = False  # ForwardBatch.req_row_stride (padded per-request rows)
    # Plans from the batch's device tensors alone (host lists give only the batch's shape),
    # so a batch whose lengths the host has not read yet attends correctly (overlapped spec).
    plans_on_device = False
    supports_tree_mask = False  # ForwardBatch.tree_mask (draft trees)
    supports_tree_graph = False  # a tree's verify can replay a decode graph
    # Full graphs of plain DECODE steps only: verifies and a draft's rounds run eagerly (a
    # backend whose other modes plan buffers anew for each batch).
    decode_graph_only = False
    # Planning reads req_to_token (flashinfer's page table): a decode graph cannot write a
    # step's new rows itself (ForwardBatch.rows_pending), they are written before planning.
    plans_from_rows = False
    # DECODE metadata is device work on the batch's tensors alone, and its host values depend
    # on the batch size only: a decode graph captures init_graph_metadata, and replays skip
    # the host call (two launches and the Python around them, a decode step at a time).
    decode_metadata_in_graph = False
    # Writes the new K/V into the paged pool (save_kv), then attends over the pool (attend).
    # The model runs save_kv as plain tensor work, so inside a piecewise graph's segment, and
    # only attend as the eager break. False (dense training attention): forward takes k, v.
    paged = True

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plans per-batch metadata before the forward (eagerly, outside any graph)."""

    def init_graph_metadata(self, batch: ForwardBatch) -> None:
        """init_forward_metadata for a batch a full graph captures or replays (a padded batch
        of a captured size): a backend whose graphs read fixed buffers plans into them here."""
        self.init_forward_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim]; returns like q."""
        self.save_kv(k, v, layer_id, batch)
        return self.attend(q, layer_id, batch)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the pool, this forward's K/V already saved. out: [T, H * D] to
        write into (rows past the real tokens keep what they held); None: a new tensor whose
        padding rows are zero."""
        raise NotImplementedError

    def rotate_and_save_kv(self, rotary, positions, q, k, v, layer_id: int,
                           batch: ForwardBatch) -> None:
        """Rotary on q and k (in place), then save_kv: on CUDA one kernel for the three
        (kernels.fused_ops.rotary_embedding_store_)."""
        from kernels import fused_ops

        pool, num_tokens = self.kv_cache.pool, k.shape[0]
        fused_ops.rotary_embedding_store_(
            positions, q, k, v, rotary.cos_sin, rotary.head_dim, pool.k_buffers[layer_id],
            pool.v_buffers[layer_id], batch.out_cache_loc[:num_tokens])

    def save_kv(self, k, v, layer_id: int, batch: ForwardBatch) -> None:
        num_tokens = k.shape[0]
        self.kv_cache.pool.write(
            layer_id, batch.out_cache_loc[:num_tokens],
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim))
