"""Paged attention through our Triton kernels (extend with prefix, split-K decode).

Metadata lives in persistent int32 buffers that `init_forward_metadata` overwrites in place, so a
decode graph captured with this backend reads the live batch's lengths on every replay.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kernels.tree_rows import tree_path_rows
from specpcg.attention import triton_extend, triton_kernels
from specpcg.attention.base import AttentionBackend
from specpcg.config import TRITON_VERIFY_KERNELS
from specpcg.core import ForwardBatch, ForwardMode


class TritonAttnBackend(AttentionBackend):
    name = "triton"
    supports_row_stride = True
    supports_cuda_graph = True
    # A chain verify's nodes read one row: one program takes all of a request's nodes, each key
    # block loaded once for them (False: a program a node, to compare; see _expand_verify).
    stack_chain_nodes = True
    supports_tree_mask = True  # as split-K decode queries over per-node rows
    supports_tree_graph = True  # a tree's node rows live in a static buffer (_tree_rows_out)
    plans_on_device = True  # host lengths: only the batch's shape (extend widths)
    decode_metadata_in_graph = True  # DECODE: two copies; splits picked from the batch size

    def __init__(self, kv_cache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 num_kv_splits=None, verify_kernel: str = "split_k"):
        """num_kv_splits: a fixed decode split count (a power of two); None picks one per batch.
        verify_kernel: how a chain's TARGET_VERIFY attends (config.TRITON_VERIFY_KERNELS); draft
        trees always take the split-K kernel, each node over a row of its own."""
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        if verify_kernel not in TRITON_VERIFY_KERNELS:
            raise ValueError(f"verify_kernel must be one of {list(TRITON_VERIFY_KERNELS)}, got "
                             f"{verify_kernel!r}")
        self.verify_kernel = verify_kernel
        self._verify_width = 0  # > 0: this batch's verify runs as split-K decode queries
        self._verify_req = self._verify_seq = None
        self._node_ids = None  # [size] int32 0, 1, ..: a tree node's row is its own
        self._verify_req_now = None  # the row index of each query: _verify_req or _node_ids
        self._verify_splits = 1
        self._verify_nodes = 1  # verify queries one kernel program takes (decode_attention)
        self._tree_rows = None  # [bs * E, L] slots while a draft tree's batch runs
        self._tree_rows_buf = None  # what graphs read _tree_rows from (see _tree_rows_out)
        self._verify_offsets: dict = {}  # width -> [width] int32: 1 - width .. 0
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads to be a multiple of num_kv_heads"
        if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits!r}")
        self._fixed_kv_splits = num_kv_splits
        self.device = kv_cache.req_pool.req_to_token.device
        self._alloc_metadata(kv_cache.req_pool.req_to_token.shape[0])
        if self.device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self._num_sms = 4  # the interpreter: any small count keeps splits few
        self._num_reqs = 0
        self._num_real_tokens = 0
        self._max_extend_len = 0
        self._num_kv_splits = 1
        self._row_stride = 0

    def _alloc_metadata(self, max_reqs: int) -> None:
        # NOTE: graphs capture these addresses; reallocating (a larger batch than any seen)
        # invalidates graphs captured before, so size for every request row up front.
        kw = dict(dtype=torch.int32, device=self.device)
        self._req_pool_indices = torch.zeros(max_reqs, **kw)  # [max_reqs]
        self._seq_lens = torch.zeros(max_reqs, **kw)  # [max_reqs]
        self._extend_lens = torch.zeros(max_reqs, **kw)  # [max_reqs]
        self._q_starts = torch.zeros(max_reqs + 1, **kw)  # [max_reqs + 1] exclusive cumsum
        # The decode kernel's arrival counters (zero between launches): a decode query each.
        self._arrived = triton_kernels.arrival_counters(max_reqs, self.num_kv_heads, self.device)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        num_reqs = batch.batch_size
        if num_reqs > self._seq_lens.shape[0]:
            self._alloc_metadata(num_reqs)
        # Copies stay on the device (no host sync); int64 batch tensors are cast to int32 here.
        # A tree's node rows are built from the batch's own tensors: no copies (two of a tree
        # step's ~20 kernels).
        lens = batch.extend_seq_lens_cpu
        stride = batch.req_row_stride
        split_verify = (batch.tree_mask is None and batch.forward_mode == ForwardMode.TARGET_VERIFY
                        and self._split_k_verify(num_reqs) and not stride and lens
                        and all(n == lens[0] for n in lens))
        if batch.tree_mask is None:
            if not split_verify:  # a split verify's nodes read their rows from _verify_req
                self._req_pool_indices[:num_reqs].copy_(batch.req_pool_indices[:num_reqs])
            self._seq_lens[:num_reqs].copy_(batch.seq_lens[:num_reqs])
        if (batch.forward_mode != ForwardMode.DECODE and batch.tree_mask is None
                and not split_verify):
            # Only the extend kernel reads query starts. NOTE: skipped for decode, a draft
            # chain's every step among them (three of a head step's ~27 kernels on the H100),
            # for trees, whose nodes run as decode queries, and for a chain verify run so.
            self._extend_lens[:num_reqs].copy_(batch.extend_seq_lens[:num_reqs])
            if stride:  # request i's queries start at row i * stride
                self._q_starts[:num_reqs + 1].copy_(torch.arange(
                    0, (num_reqs + 1) * stride, stride, dtype=torch.int32, device=self.device))
            else:
                torch.cumsum(self._extend_lens[:num_reqs], dim=0, dtype=torch.int32,
                             out=self._q_starts[1:num_reqs + 1])
        self._num_reqs = num_reqs
        self._row_stride = stride
        self._num_real_tokens = int(sum(lens))
        self._max_extend_len = int(max(lens, default=0))
        self._num_kv_splits = self._fixed_kv_splits or triton_kernels.pick_num_kv_splits(
            num_reqs, self.num_kv_heads, self._num_sms)
        self._verify_width = 0
        self._tree_rows = None
        if batch.tree_mask is not None:
            self._expand_tree(num_reqs, batch, stride)
        elif split_verify:
            self._expand_verify(num_reqs, lens[0], batch.req_pool_indices)

    def _split_k_verify(self, num_reqs: int) -> bool:
        """Whether a chain verify of num_reqs requests runs its nodes as split-K decode queries.
        auto: while the extend kernel's programs (a request's query block per head) would leave
        SMs idle, as at batch 1, where split-K spreads each node's keys over many programs; on
        CPU (the interpreter) always, as before auto existed."""
        if self.verify_kernel != "auto":
            return self.verify_kernel == "split_k"
        return self.device.type != "cuda" or num_reqs * self.num_heads < self._num_sms

    def _expand_tree(self, num_reqs: int, batch: ForwardBatch, stride: int) -> None:
        """A draft tree's E queries per request (verify nodes, or a draft step's branches) as
        split-K decode queries, node by node over a row of its own: the prefix, then the keys
        its mask allows (kernels.tree_rows.tree_path_rows), so a node attends exactly as the decode
        at its position will. The rows are built here, outside any graph, into a static buffer
        that a TARGET_VERIFY tree graph reads."""
        tree_mask = batch.tree_mask
        bs, width, _ = tree_mask.shape
        if stride or bs != num_reqs:
            raise ValueError(f"a tree batch needs one [E, K] mask per request and packed rows, "
                             f"got mask {tuple(tree_mask.shape)} for {num_reqs} requests, "
                             f"stride {stride}")
        n = self._size_verify(num_reqs, width, nodes=1)
        # NOTE: rows as wide as the pool's, whatever the batch's longest sequence: the decode
        # kernel's split count is a compile-time constant of that width, so a width that grew
        # with the sequences compiled the kernels again each time it crossed a split.
        req_to_token = self.kv_cache.req_pool.req_to_token
        self._tree_rows, _ = tree_path_rows(
            req_to_token, batch.req_pool_indices[:num_reqs], batch.seq_lens[:num_reqs],
            tree_mask, req_to_token.shape[1], out=self._tree_rows_out(n, req_to_token.shape[1]),
            lens_out=self._verify_seq[:n])
        self._verify_req_now = self._node_ids[:n]  # node e of request i reads row i * E + e

    def _tree_rows_out(self, n: int, width: int):
        """Where n node rows are built: the buffer graphs read, or None (rows of their own)
        when they do not fit. NOTE: the first tree batch sizes the buffer for good: with graphs
        on that is a graph's capture (largest bucket first), and a reallocation would leave
        every graph captured before it reading freed memory. A larger batch runs eagerly."""
        if self._tree_rows_buf is None:
            self._tree_rows_buf = torch.empty(
                n, width, dtype=self.kv_cache.req_pool.req_to_token.dtype, device=self.device)
        return self._tree_rows_buf[:n] if self._tree_rows_buf.shape[0] >= n else None

    def _expand_verify(self, num_reqs: int, width: int, req_rows: torch.Tensor) -> None:
        """Per-query request rows and key counts of num_reqs * width decode queries (the nodes'
        own KV is saved before the kernel runs): node j sees its row up to itself (a chain).
        With stack_chain_nodes one kernel program takes a request's nodes: a program a node
        read each key once a node (the 8B shape's verify attention at batch 64 took 3.3 ms a
        step on the H100, its decode's 0.9 ms; stacked, 1.3 ms)."""
        n = self._size_verify(num_reqs, width, self._nodes_a_program(num_reqs, width))
        self._verify_req[:n].view(num_reqs, width).copy_(
            req_rows[:num_reqs, None].expand(num_reqs, width))
        seq = self._verify_seq[:n].view(num_reqs, width)
        offsets = self._verify_offsets.get(width)
        if offsets is None:
            offsets = self._verify_offsets[width] = torch.arange(
                1 - width, 1, dtype=torch.int32, device=self.device)
        torch.add(self._seq_lens[:num_reqs, None], offsets[None, :], out=seq)

    def _stacks_nodes(self) -> bool:
        """Whether a chain verify's nodes share a program. NOTE: not in float32 on a GPU: its
        dot runs without tensor cores, and with nodes stacked it came out different in the last
        bits (H100, tests/test_batch_invariance.py), where bf16 was bitwise the same."""
        fp32_gpu = self.device.type == "cuda" and self.kv_cache.pool.dtype == torch.float32
        return self.stack_chain_nodes and not fp32_gpu

    def _nodes_a_program(self, num_reqs: int, width: int) -> int:
        """A chain verify's nodes a kernel program. All of a request's, unless their query rows
        (nodes x heads a KV head) pass the 16 a decode program takes and the programs are few
        beside the SMs: then the most nodes (2 or more) that fit in 16 rows and divide the
        width, so a request's nodes take two or more programs of decode's shape (whose merge
        takes 8 splits a round). Which programs take which nodes never changes a result
        (tests/test_batch_invariance.py)."""
        if not self._stacks_nodes():
            return 1
        fit = _largest_divisor_at_most(width, 16 // (self.num_heads // self.num_kv_heads))
        # NOTE: a second program a request reads its keys again. On one H200 (8 nodes;
        # benchmarks/probe_decode_attn.py --stack 4) 4 nodes a program took batch 1 at 4,096 keys
        # from 22.3 to 17.3 us a call (default model) and 40.6 to 26.7 (8B shape), but the 8B
        # shape at batch 16 from 15.1 to 19.7 at 256 keys: so only while programs are few.
        # All of a request's nodes where they fit in 16 rows (fit == width) or where none does
        # (fit 0); one node a program (fit 1) would share no key loads.
        if fit > 1 and num_reqs * self.num_kv_heads * (width // fit) <= self._num_sms:
            return fit
        return width

    def _size_verify(self, num_reqs: int, width: int, nodes: int) -> int:
        """Room for num_reqs * width decode queries, `nodes` of them a kernel program, and
        their split count; returns how many."""
        n = num_reqs * width
        if self._verify_req is None or self._verify_req.shape[0] < n:
            # NOTE: graphs read these addresses; a verify graph's capture (largest bucket
            # first) sizes them for every request row once.
            size = max(n, self._req_pool_indices.shape[0] * width)
            self._verify_req = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._verify_seq = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._node_ids = torch.arange(size, dtype=torch.int32, device=self.device)
            self._verify_arrived = triton_kernels.arrival_counters(size, self.num_kv_heads,
                                                                   self.device)
        self._verify_req_now = self._verify_req
        self._verify_width, self._verify_nodes = width, nodes
        self._verify_splits = self._fixed_kv_splits or triton_kernels.pick_num_kv_splits(
            n // nodes, self.num_kv_heads, self._num_sms)
        return n

    def attend(self, q, layer_id: int, batch: ForwardBatch, out=None) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; one kernel launch when `out` is given (a piecewise
        graph's break); else rows past the real tokens (padding) come back as zeros."""
        assert self._num_reqs == batch.batch_size, "call init_forward_metadata(batch) first"
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, self.num_heads, self.head_dim)
        zero_padding = out is None
        if out is None:
            # Padding rows between a strided batch's requests are never written by the kernel.
            alloc = torch.zeros if self._row_stride else torch.empty
            out = alloc(num_tokens, self.num_heads * self.head_dim, dtype=q.dtype,
                        device=q.device)  # [T, H * D]
        out3 = out.view(num_tokens, self.num_heads, self.head_dim)
        pool = self.kv_cache.pool
        req_to_token = self.kv_cache.req_pool.req_to_token
        if self._verify_width:
            num_real = self._num_real_tokens  # every node is a query, in row order
            rows = req_to_token if self._tree_rows is None else self._tree_rows
            triton_kernels.decode_attention(
                q3, pool.k_buffers[layer_id], pool.v_buffers[layer_id], out3, rows,
                self._verify_req_now, self._verify_seq, self._num_reqs * self._verify_width,
                self._verify_splits, self.scale, self._verify_arrived, self._verify_nodes)
        elif batch.forward_mode == ForwardMode.DECODE:
            num_real = self._num_reqs  # one query per request, request i in row i
            triton_kernels.decode_attention(
                q3, pool.k_buffers[layer_id], pool.v_buffers[layer_id], out3, req_to_token,
                self._req_pool_indices, self._seq_lens, self._num_reqs, self._num_kv_splits,
                self.scale, self._arrived)
        else:
            num_real = self._num_real_tokens
            triton_extend.extend_attention(
                q3, pool.k_buffers[layer_id], pool.v_buffers[layer_id], out3, req_to_token,
                self._req_pool_indices, self._seq_lens, self._extend_lens, self._q_starts,
                self._max_extend_len, self._num_reqs, self.scale)
        if zero_padding and num_tokens > num_real and not self._row_stride:
            # Padding rows hold no request; zeros keep NaN/garbage out of the layers after us.
            out[num_real:].zero_()
        return out


@lru_cache(maxsize=None)
def _largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n that is at most cap (0 where cap < 1). Cached: a verify's width
    and the model's heads repeat every step."""
    return max((d for d in range(1, min(n, cap) + 1) if n % d == 0), default=0)
