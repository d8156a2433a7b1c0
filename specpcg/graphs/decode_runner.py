"""Full CUDA graphs for DECODE and TARGET_VERIFY: one graph per (mode, batch-size bucket).

Attention is inside the graph, so the backend must keep its metadata in static buffers
(`supports_cuda_graph`). Padded requests sit on the KV pool's padding row (all sink slots) and
write their KV to the sink slot; their outputs are sliced away.

An engine drafting trees (topk > 1) captures its TARGET_VERIFY graphs with tree attention: the
live batch's masks are copied into a static [bs, N, N] buffer (padded requests get a chain's),
and the backend builds each node's row from them before the replay (`supports_tree_graph`).
"""

from __future__ import annotations


import torch

from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.breakable import CaptureCost, warm_and_capture
from specpcg.graphs.buckets import pick_bucket
from specpcg.graphs.piecewise_runner import StaticInputs
from specpcg.router import Refusal, hidden_refusal


class DecodeGraphRunner:
    def __init__(self, model_runner, batch_buckets: list, hidden_mode: CaptureHiddenMode,
                 aux_layers: tuple, pool, num_verify_tokens: int = 0, verify_tree: bool = False,
                 show_progress: bool = True):
        """num_verify_tokens: tokens per request of TARGET_VERIFY graphs (0: none captured).
        verify_tree: those graphs verify draft trees (every verify then carries a tree mask)."""
        self.model_runner = model_runner
        self.buckets = sorted(batch_buckets)
        self.hidden_mode = hidden_mode
        self.aux_layers = tuple(aux_layers)
        self.pool = pool
        self.show_progress = show_progress
        self.tokens_per_req = {ForwardMode.DECODE: 1}
        if num_verify_tokens:
            self.tokens_per_req[ForwardMode.TARGET_VERIFY] = num_verify_tokens
        max_tokens = self.buckets[-1] * max(self.tokens_per_req.values())
        model = model_runner.model
        self.inputs = StaticInputs(max_tokens, model_runner.device,
                                   getattr(model, "hidden_in_size", 0), model.head_weight.dtype)
        dev = model_runner.device
        self.req_pool_indices = torch.zeros(self.buckets[-1], dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(self.buckets[-1], dtype=torch.int32, device=dev)
        self.extend_lens = torch.ones(self.buckets[-1], dtype=torch.int32, device=dev)
        self.verify_tree = bool(verify_tree and num_verify_tokens)
        self.tree_mask = self.chain_mask = None
        if self.verify_tree:  # [max_bs, N, N]; a chain's mask is what padded requests attend by
            n = num_verify_tokens
            self.chain_mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            self.tree_mask = self.chain_mask.repeat(self.buckets[-1], 1, 1)
        self.graphs: dict = {}  # (mode, bs) -> CUDAGraph
        self.outputs: dict = {}
        self.cost = CaptureCost()

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def refusal(self, batch: ForwardBatch):
        width = self.tokens_per_req.get(batch.forward_mode)
        if width is None:
            return Refusal.MODE_NOT_CAPTURED
        if any(n != width for n in batch.extend_seq_lens_cpu):
            return Refusal.TOKENS_PER_REQUEST
        tree_graph = self.verify_tree and batch.forward_mode == ForwardMode.TARGET_VERIFY
        if tree_graph and batch.tree_mask is None:
            return Refusal.CHAIN_NOT_CAPTURED
        if batch.tree_mask is not None and (
                not tree_graph or tuple(batch.tree_mask.shape[1:]) != (width, width)):
            return Refusal.TREE_MASK
        if batch.batch_size > self.max_bs:
            return Refusal.TOO_MANY_REQUESTS
        if batch.return_all_logits and batch.forward_mode == ForwardMode.DECODE:
            return Refusal.INPUT_LOGPROBS
        return hidden_refusal(batch, self.hidden_mode, self.aux_layers)

    def _padded_batch(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """The live batch padded to `bs` requests, over the static buffers."""
        width = self.tokens_per_req[batch.forward_mode]
        n = batch.batch_size
        pad_row = self.model_runner.kv_cache.req_pool.pad_row
        self.req_pool_indices[:n].copy_(batch.req_pool_indices)
        self.req_pool_indices[n:bs].fill_(pad_row)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.seq_lens[n:bs].fill_(width)
        self.extend_lens[:bs].fill_(width)
        padded = self.inputs.load(batch, bs * width)
        padded.req_pool_indices = self.req_pool_indices[:bs]
        padded.seq_lens = self.seq_lens[:bs]
        padded.extend_seq_lens = self.extend_lens[:bs]
        padded.seq_lens_cpu = list(batch.seq_lens_cpu) + [width] * (bs - n)
        padded.extend_seq_lens_cpu = [width] * bs
        if batch.tree_mask is not None:
            self.tree_mask[:n].copy_(batch.tree_mask)
            self.tree_mask[n:bs].copy_(self.chain_mask.expand(bs - n, width, width))
            padded.tree_mask = self.tree_mask[:bs]
        return padded

    def capture(self) -> None:
        from tqdm import tqdm

        keys = [(m, bs) for m in self.tokens_per_req for bs in sorted(self.buckets, reverse=True)]
        with self.cost.measure("decode graphs", len(keys)):
            for mode, bs in tqdm(keys, desc="capturing decode graphs",
                                 disable=not self.show_progress):
                self._capture_one(mode, bs)

    def _capture_one(self, mode: ForwardMode, bs: int) -> None:
        width = self.tokens_per_req[mode]
        pad_row = self.model_runner.kv_cache.req_pool.pad_row
        dev = self.model_runner.device
        dummy = ForwardBatch(
            forward_mode=mode, input_ids=self.inputs.input_ids[:bs * width],
            positions=self.inputs.positions[:bs * width],
            out_cache_loc=self.inputs.out_cache_loc[:bs * width],
            req_pool_indices=torch.full((bs,), pad_row, dtype=torch.long, device=dev),
            seq_lens=torch.full((bs,), width, dtype=torch.int32, device=dev),
            extend_seq_lens=torch.full((bs,), width, dtype=torch.int32, device=dev),
            seq_lens_cpu=[width] * bs, extend_seq_lens_cpu=[width] * bs,
            capture_hidden_mode=self.hidden_mode, aux_hidden_layers=self.aux_layers,
            input_hidden=None if self.inputs.input_hidden is None
            else self.inputs.input_hidden[:bs * width])
        if self.verify_tree and mode == ForwardMode.TARGET_VERIFY:
            dummy.tree_mask = self.chain_mask.expand(bs, width, width)
        batch = self._padded_batch(dummy, bs)
        attn = self.model_runner.attn_backend
        attn.init_forward_metadata(batch)
        with forward_context(ForwardContext(batch, attn, bs * width)):
            graph, self.outputs[(mode, bs)] = warm_and_capture(lambda: self._body(batch),
                                                               self.pool)
        self.graphs[(mode, bs)] = graph

    def _body(self, batch: ForwardBatch):
        """The model and its LM head on every row: logits come out of the graph, which saves
        the host the LM head's launches on every step (a decode step is latency-bound)."""
        hidden, aux = self.model_runner.call_model(batch)
        return hidden, aux, self.model_runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch):
        bs = pick_bucket(self.buckets, batch.batch_size)
        padded = self._padded_batch(batch, bs)
        attn = self.model_runner.attn_backend
        attn.init_forward_metadata(padded)
        self.graphs[(batch.forward_mode, bs)].replay()
        hidden, aux, logits = self.outputs[(batch.forward_mode, bs)]
        return self.model_runner.postprocess(hidden, list(aux), batch, logits)

    def info(self) -> dict:
        return {"batch_sizes": self.buckets,
                "modes": {m.name: w for m, w in self.tokens_per_req.items()},
                "verify_tree": self.verify_tree,
                "hidden_mode": self.hidden_mode.name,
                **self.cost.info()}
