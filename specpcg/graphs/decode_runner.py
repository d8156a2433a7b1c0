"""Full CUDA graphs for DECODE and TARGET_VERIFY (and a head's tree steps): one graph per
(mode, tree key count, batch-size bucket).

Attention is inside the graph, so the backend must keep its metadata in static buffers
(`supports_cuda_graph`). Padded requests sit on the KV pool's padding row (all sink slots) and
write their KV to the sink slot; their outputs are sliced away.

An engine drafting trees (topk > 1) captures its TARGET_VERIFY graphs with tree attention, and
a head drafting trees its tree steps (DRAFT_EXTEND, one graph per step's key count): the live
batch's masks are copied into a static buffer (padded requests get a chain's), and the backend
builds each node's row from them before the replay (`supports_tree_graph`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kernels.topk import argmax_rows
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.breakable import CaptureCost, warm_and_capture
from specpcg.graphs.buckets import pick_bucket
from specpcg.graphs.piecewise_runner import StaticInputs
from specpcg.kv_cache import SINK_SLOT
from specpcg.router import Refusal, hidden_refusal


class StepViews(NamedTuple):
    """Views of a DecodeGraphRunner's static buffers that a step of n requests in bucket bs
    reads and writes (`DecodeGraphRunner._views`)."""
    block: torch.Tensor  # the five rows' first n columns: a DECODE block's copy goes here
    ids: torch.Tensor  # row 0's first n: ids carried on the device
    pad: torch.Tensor  # the five rows' columns n..bs, and what padding holds there
    pad_src: torch.Tensor
    ids_all: torch.Tensor  # rows 0-2's first bs: the padded batch's ids, positions, slots
    positions: torch.Tensor
    slots: torch.Tensor
    row_lens: torch.Tensor  # row 4 (seq lens a graph copies itself), n and n..bs
    row_lens_pad: torch.Tensor
    pool_rows: torch.Tensor  # request rows, n, n..bs and bs
    pool_rows_pad: torch.Tensor
    pool_rows_all: torch.Tensor
    lens: torch.Tensor  # the int32 seq lens, n, n..bs and bs
    lens_pad: torch.Tensor
    lens_all: torch.Tensor
    ext_lens: torch.Tensor  # extend lens, bs


class DecodeGraphRunner:
    def __init__(self, model_runner, batch_buckets: list, hidden_mode: CaptureHiddenMode,
                 aux_layers: tuple, pool, num_verify_tokens: int = 0, verify_tree: bool = False,
                 show_progress: bool = True, draft_tree: tuple = (), write_rows: bool = False):
        """num_verify_tokens: tokens per request of TARGET_VERIFY graphs (0: none captured).
        verify_tree: those graphs verify draft trees (every verify then carries a tree mask).
        draft_tree: (topk, num_steps) of a head drafting trees: DRAFT_EXTEND graphs of its tree
        steps, topk branches per request over topk * s tree keys at step s = 1 .. num_steps - 1.
        write_rows: DECODE graphs write the step's req_to_token entries themselves (a batch's
        rows_pending), where the backend plans without reading them. Only for a runner whose
        DECODE batches all come from make_batch (the target's): the write is then the same
        one extend_many would have made, so replaying a batch already written is harmless."""
        self.model_runner = model_runner
        self.buckets = sorted(batch_buckets)
        self.hidden_mode = hidden_mode
        self.aux_layers = tuple(aux_layers)
        self.pool = pool
        self.show_progress = show_progress
        self.tokens_per_req = {ForwardMode.DECODE: 1}
        # mode -> the tree key counts its graphs hold; a mode listed here replays trees only.
        self.tree_keys: dict = {}
        if num_verify_tokens:
            self.tokens_per_req[ForwardMode.TARGET_VERIFY] = num_verify_tokens
            if verify_tree:
                self.tree_keys[ForwardMode.TARGET_VERIFY] = (num_verify_tokens,)
        if draft_tree and draft_tree[1] > 1:
            topk, steps = draft_tree
            self.tokens_per_req[ForwardMode.DRAFT_EXTEND] = topk
            self.tree_keys[ForwardMode.DRAFT_EXTEND] = tuple(topk * s for s in range(1, steps))
        self.write_rows = write_rows and not model_runner.attn_backend.plans_from_rows
        # DECODE graphs also take each row's greedy pick (the sampler's kernel): at batch 1 its
        # two launches were a third of the host's step (docs/PERFORMANCE.md).
        self.greedy_in_graph = os.environ.get("SPECPCG_GREEDY_IN_GRAPH", "1") != "0"
        # A head's hidden ring written by the greedy pick's first kernel (one launch less a
        # plain step; SPECPCG_RING_IN_PICK=0: a launch of its own after the pick).
        self.ring_pick = os.environ.get("SPECPCG_RING_IN_PICK", "1") != "0"
        max_tokens = self.buckets[-1] * max(self.tokens_per_req.values())
        model = model_runner.model
        dev = model_runner.device
        # Input ids, positions, slots, request rows and seq lens: a DECODE batch's five are one
        # block of make_batch's packed copy (index_rows), loaded here with one copy. A DECODE
        # graph that plans its attention itself takes its seq lens from the block's last row
        # (`_body`): on an H200 each copy the host queues costs it 12-16 us
        # (benchmarks/probe_pinned.py), of a batch-1 step whose host work sets its pace.
        self._rows = torch.zeros(5, max_tokens, dtype=torch.long, device=dev)
        self.inputs = StaticInputs(max_tokens, dev, getattr(model, "hidden_in_size", 0),
                                   model.head_weight.dtype, rows=self._rows[:3])
        self.req_pool_indices = self._rows[3, :self.buckets[-1]]
        # What padded requests of a DECODE batch hold in those rows: token 0 at position 0,
        # its KV to the sink slot, on the padding row, one key.
        pad = [0, 0, SINK_SLOT, model_runner.kv_cache.req_pool.pad_row, 1]
        self._pad_rows = torch.tensor(pad, dtype=torch.long, device=dev)[:, None].repeat(
            1, self.buckets[-1])
        self.seq_lens = torch.ones(self.buckets[-1], dtype=torch.int32, device=dev)
        self.extend_lens = torch.ones(self.buckets[-1], dtype=torch.int32, device=dev)
        self._extend_lens_hold = None  # (width, bs) extend_lens[:bs] holds (skips the fill)
        self._view_cache: dict = {}  # (n, bs) -> StepViews
        # (mode, keys) -> [max_bs, width, keys]: the live masks are copied in; padded requests
        # keep a chain over the last `width` keys (any valid mask would do: they are sliced away).
        self.tree_masks, self.tree_pads = {}, {}
        for mode, all_keys in self.tree_keys.items():
            width = self.tokens_per_req[mode]
            for keys in all_keys:
                pad = torch.ones(width, keys, dtype=torch.bool, device=dev).tril(keys - width)
                self.tree_pads[(mode, keys)] = pad
                self.tree_masks[(mode, keys)] = pad.repeat(self.buckets[-1], 1, 1)
        self.graphs: dict = {}  # (mode, tree keys or 0, bs) -> CUDAGraph
        self.ring_in_graph = False  # DECODE graphs write the draft's hidden ring (_body)
        self.outputs: dict = {}
        self.cost = CaptureCost()

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    @property
    def verify_tree(self) -> bool:
        return ForwardMode.TARGET_VERIFY in self.tree_keys

    def refusal(self, batch: ForwardBatch):
        width = self.tokens_per_req.get(batch.forward_mode)
        if width is None:
            return Refusal.MODE_NOT_CAPTURED
        if any(n != width for n in batch.extend_seq_lens_cpu):
            return Refusal.TOKENS_PER_REQUEST
        tree_keys = self.tree_keys.get(batch.forward_mode, ())
        if tree_keys and batch.tree_mask is None:
            return Refusal.CHAIN_NOT_CAPTURED
        if batch.tree_mask is not None and (batch.tree_mask.shape[1] != width
                                            or batch.tree_mask.shape[2] not in tree_keys):
            return Refusal.TREE_MASK
        if batch.batch_size > self.max_bs:
            return Refusal.TOO_MANY_REQUESTS
        if batch.return_all_logits and batch.forward_mode == ForwardMode.DECODE:
            return Refusal.INPUT_LOGPROBS
        return hidden_refusal(batch, self.hidden_mode, self.aux_layers)

    @staticmethod
    def _keys(batch: ForwardBatch) -> int:
        return 0 if batch.tree_mask is None else batch.tree_mask.shape[2]

    def _metadata_in_graph(self, mode: ForwardMode) -> bool:
        return (mode == ForwardMode.DECODE
                and self.model_runner.attn_backend.decode_metadata_in_graph)

    def _lens_in_graph(self, mode: ForwardMode) -> bool:
        """Whether the graph copies its seq lens from the block's row itself: where nothing
        on the host reads them before the replay (the attention's plan is in the graph)."""
        return self._metadata_in_graph(mode)

    def writes_rows(self, batch: ForwardBatch) -> bool:
        """Whether replaying `batch` writes its req_to_token entries (see write_rows)."""
        return self.write_rows and batch.forward_mode == ForwardMode.DECODE

    def _loads_block(self, batch: ForwardBatch, width: int) -> bool:
        rows = batch.index_rows
        if width != 1 or rows is None or batch.tree_mask is not None or \
                self.inputs.input_hidden is not None:
            return False
        # Positions, slots, request rows and seq lens still the block's (input ids may be
        # replaced): row i of the block starts i strides in (no views made to compare).
        base, step = rows.data_ptr(), rows.stride(0) * rows.element_size()
        return (batch.positions.data_ptr() == base + step
                and batch.out_cache_loc.data_ptr() == base + 2 * step
                and batch.req_pool_indices.data_ptr() == base + 3 * step
                and batch.seq_lens.data_ptr() == base + 4 * step)

    def _views(self, n: int, bs: int) -> StepViews:
        """The static buffers' views a step of n requests in bucket bs reads and writes, made
        once: each slice of a device tensor costs an H200's host 2-4 us, in a batch-1 step
        whose host work sets its pace."""
        views = self._view_cache.get((n, bs))
        if views is None:
            rows = self._rows
            views = self._view_cache[(n, bs)] = StepViews(
                rows[:, :n], rows[0, :n], rows[:, n:bs], self._pad_rows[:, :bs - n],
                rows[0, :bs], rows[1, :bs], rows[2, :bs], rows[4, :n], rows[4, n:bs],
                self.req_pool_indices[:n], self.req_pool_indices[n:bs],
                self.req_pool_indices[:bs], self.seq_lens[:n], self.seq_lens[n:bs],
                self.seq_lens[:bs], self.extend_lens[:bs])
        return views

    def _load_block(self, batch: ForwardBatch, v: StepViews) -> ForwardBatch:
        """A DECODE batch's ids, positions, slots, request rows and seq lens in one copy, its
        padding in another (a step at a captured size has none): at batch 1 the host's work
        between two decode steps is most of a small model's step."""
        v.block.copy_(batch.index_rows)
        if batch.input_ids.data_ptr() != batch.index_rows.data_ptr():
            v.ids.copy_(batch.input_ids)  # ids carried on the device (overlap)
        if v.pad.shape[1]:
            v.pad.copy_(v.pad_src)
        padded = object.__new__(ForwardBatch)  # a copy (dataclasses.replace: 5x the time)
        padded.__dict__.update(batch.__dict__)
        padded.input_ids, padded.positions, padded.out_cache_loc = v.ids_all, v.positions, v.slots
        padded.index_rows = None
        return padded

    def _padded_batch(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """The live batch padded to `bs` requests, over the static buffers."""
        width = self.tokens_per_req[batch.forward_mode]
        keys = self._keys(batch)
        pad_len = max(width, keys)  # a padded request's row holds at least its tree's keys
        n = batch.batch_size
        v = self._views(n, bs)
        block = self._loads_block(batch, width)
        if block:
            padded = self._load_block(batch, v)
        else:
            v.pool_rows.copy_(batch.req_pool_indices)
            if bs > n:
                v.pool_rows_pad.fill_(self.model_runner.kv_cache.req_pool.pad_row)
            padded = self.inputs.load(batch, bs * width)
        in_graph = self._lens_in_graph(batch.forward_mode)
        if not (block and in_graph):  # else the block's copy brought them
            (v.row_lens if in_graph else v.lens).copy_(batch.seq_lens)
            if bs > n:
                (v.row_lens_pad if in_graph else v.lens_pad).fill_(pad_len)
        if self._extend_lens_hold != (width, bs):
            v.ext_lens.fill_(width)
            self._extend_lens_hold = (width, bs)
        padded.req_pool_indices = v.pool_rows_all
        padded.seq_lens = v.lens_all
        padded.extend_seq_lens = v.ext_lens
        padded.seq_lens_cpu = list(batch.seq_lens_cpu) + [pad_len] * (bs - n)
        padded.extend_seq_lens_cpu = [width] * bs
        if keys:
            shape = (batch.forward_mode, keys)
            mask = self.tree_masks[shape]
            mask[:n].copy_(batch.tree_mask)
            mask[n:bs].copy_(self.tree_pads[shape].expand(bs - n, width, keys))
            padded.tree_mask = mask[:bs]
        return padded

    def capture(self) -> None:
        from tqdm import tqdm

        shapes = [(m, k) for m in self.tokens_per_req for k in self.tree_keys.get(m, (0,))]
        keys = [(m, k, bs) for m, k in shapes for bs in sorted(self.buckets, reverse=True)]
        with self.cost.measure("decode graphs", len(keys)):
            for mode, tree_keys, bs in tqdm(keys, desc="capturing decode graphs",
                                            disable=not self.show_progress):
                self._capture_one(mode, tree_keys, bs)

    def _capture_one(self, mode: ForwardMode, keys: int, bs: int) -> None:
        width = self.tokens_per_req[mode]
        pad_row = self.model_runner.kv_cache.req_pool.pad_row
        dev = self.model_runner.device
        pad_len = max(width, keys)
        dummy = ForwardBatch(
            forward_mode=mode, input_ids=self.inputs.input_ids[:bs * width],
            positions=self.inputs.positions[:bs * width],
            out_cache_loc=self.inputs.out_cache_loc[:bs * width],
            req_pool_indices=torch.full((bs,), pad_row, dtype=torch.long, device=dev),
            seq_lens=torch.full((bs,), pad_len, dtype=torch.int32, device=dev),
            extend_seq_lens=torch.full((bs,), width, dtype=torch.int32, device=dev),
            seq_lens_cpu=[pad_len] * bs, extend_seq_lens_cpu=[width] * bs,
            capture_hidden_mode=self.hidden_mode, aux_hidden_layers=self.aux_layers,
            input_hidden=None if self.inputs.input_hidden is None
            else self.inputs.input_hidden[:bs * width])
        if keys:
            dummy.tree_mask = self.tree_pads[(mode, keys)].expand(bs, width, keys)
        batch = self._padded_batch(dummy, bs)
        attn = self.model_runner.attn_backend
        attn.init_graph_metadata(batch)
        with forward_context(ForwardContext(batch, attn, bs * width)):
            graph, self.outputs[(mode, keys, bs)] = warm_and_capture(
                lambda: self._body(batch), self.pool)
        self.graphs[(mode, keys, bs)] = graph
        argmax_rows(self.outputs[(mode, keys, bs)][2])  # sampler.sample's, compiled before serving

    def _body(self, batch: ForwardBatch):
        """The model and its LM head on every row: logits come out of the graph, which saves
        the host the LM head's launches on every step (a decode step is latency-bound); for a
        DECODE graph also each row's greedy pick (see greedy_in_graph), else None."""
        if self._lens_in_graph(batch.forward_mode):
            bs = batch.batch_size
            self.seq_lens[:bs].copy_(self._rows[4, :bs])
        if self.writes_rows(batch):  # padding writes the sink slot at column 0 of the
            # padding row, which holds sink slots only
            self.model_runner.kv_cache.write_rows(batch)
        if self._metadata_in_graph(batch.forward_mode):
            self.model_runner.attn_backend.init_graph_metadata(batch)
        hidden, aux = self.model_runner.call_model(batch)
        logits = self.model_runner.model.compute_logits(hidden)
        pick = self.greedy_in_graph and batch.forward_mode == ForwardMode.DECODE
        ring = self.model_runner.writes_ring(batch)
        fused = pick and ring and self.ring_pick
        greedy = argmax_rows(logits) if pick and not fused else None
        if ring:  # nothing copied out after the replay: the greedy pick's launch writes the
            # rows (ring_pick), else a launch of their own, last, so that the chain of launches
            # before it stays unbroken (kernels/dispatch.py, pdl)
            picked = self.model_runner.write_ring(batch, hidden, aux, logits if fused else None)
            greedy = picked if fused else greedy
            self.ring_in_graph = True
        return hidden, aux, logits, greedy

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch):
        bs = pick_bucket(self.buckets, batch.batch_size)
        padded = self._padded_batch(batch, bs)
        if not self._metadata_in_graph(batch.forward_mode):
            self.model_runner.attn_backend.init_graph_metadata(padded)
        key = (batch.forward_mode, self._keys(batch), bs)
        self.graphs[key].replay()
        if self.writes_rows(batch):
            batch.rows_pending = False
        hidden, aux, logits, greedy = self.outputs[key]
        runner = self.model_runner
        if self.ring_in_graph and runner.writes_ring(batch):
            return runner.postprocess(hidden, [], batch, logits, greedy, in_ring=True)
        return runner.postprocess(hidden, list(aux), batch, logits, greedy)

    def info(self) -> dict:
        return {"batch_sizes": self.buckets,
                "modes": {m.name: w for m, w in self.tokens_per_req.items()},
                "tree_keys": {m.name: list(k) for m, k in self.tree_keys.items()},
                "hidden_mode": self.hidden_mode.name,
                **self.cost.info()}
