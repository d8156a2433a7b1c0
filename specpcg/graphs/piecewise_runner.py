"""Piecewise CUDA graphs for EXTEND: the transformer body per token-count bucket, attention eager.

Runners own *what* is captured (buckets, static buffers, padding); `breakable.py` owns *how*.
Only the body is captured: the LM head, logits and sampling run eagerly after it, so one graph
serves batches of many requests and last-token logprobs. Padded tokens write KV to the sink slot.

Nothing in a segment depends on the forward mode (attention, the one part that does, is a
break), so where no full decode graph can be built (tensor parallelism, whose collectives must
run between segments; an attention backend that plans from host lengths) the same graphs also
serve decode steps and verifies (`decode_modes`; policy.piecewise_serves_decode).
"""

from __future__ import annotations

import dataclasses

import torch

from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.forward_context import ForwardContext, forward_context
from specpcg.graphs.breakable import (BreakableGraph, CaptureCost, breakable_capture,
                                      capture_stream, joined_capture_stream)
from specpcg.graphs.buckets import pick_bucket
from specpcg.graphs.staging import StagingArena
from specpcg.kv_cache import SINK_SLOT
from specpcg.router import Refusal, hidden_refusal


class StaticInputs:
    """Input buffers every graph reads; replay copies the live batch in and pads the rest."""

    def __init__(self, max_tokens: int, device, hidden_size: int = 0, dtype=None,
                 rows: torch.Tensor | None = None):
        """hidden_size > 0: also a hidden-state input (draft heads), [max_tokens, hidden_size].
        rows: [>= 3, max_tokens] long whose first rows hold input ids, positions and slots (a
        decode graph loads the three with one copy)."""
        self.input_hidden = (torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
                             if hidden_size else None)
        if rows is None:
            rows = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_cache_loc = rows[0], rows[1], rows[2]
        self.out_cache_loc.fill_(SINK_SLOT)

    def pad_row_batch(self, kv_cache, num_tokens: int, **extra) -> ForwardBatch:
        """A capture's stand-in: one EXTEND request of `num_tokens` tokens over these buffers, on
        the padding row, so all its KV is the sink slot."""
        dev = self.input_ids.device
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens], out_cache_loc=self.out_cache_loc[:num_tokens],
            req_pool_indices=torch.tensor([kv_cache.req_pool.pad_row], device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            extend_seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            seq_lens_cpu=[num_tokens], extend_seq_lens_cpu=[num_tokens], **extra)

    def load(self, batch: ForwardBatch, num_padded: int) -> ForwardBatch:
        """Copies the batch's tokens in, pads to `num_padded`; returns the batch over the buffers."""
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        # NOTE: padded tokens must write KV to the sink slot, never into a live request's slot.
        if num_padded > n:  # empty fills still cost the host a dispatch each
            self.input_ids[n:num_padded].zero_()
            self.positions[n:num_padded].zero_()
            self.out_cache_loc[n:num_padded].fill_(SINK_SLOT)
        hidden = None
        if self.input_hidden is not None:
            self.input_hidden[:n].copy_(batch.input_hidden)
            hidden = self.input_hidden[:num_padded]
        return dataclasses.replace(batch, input_ids=self.input_ids[:num_padded],
                                   positions=self.positions[:num_padded],
                                   out_cache_loc=self.out_cache_loc[:num_padded],
                                   input_hidden=hidden)


DECODE_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


class PiecewiseRunner:
    modes = (ForwardMode.EXTEND,)

    def __init__(self, model_runner, buckets: list, hidden_mode: CaptureHiddenMode,
                 aux_layers: tuple, pool, show_progress: bool = True, decode_modes: bool = False):
        """decode_modes: also serve DECODE and TARGET_VERIFY (no full decode graph exists)."""
        self.modes = (ForwardMode.EXTEND,) + (DECODE_MODES if decode_modes else ())
        self.model_runner = model_runner
        self.buckets = sorted(buckets)
        self.hidden_mode = hidden_mode
        self.aux_layers = tuple(aux_layers)
        self.pool = pool
        self.show_progress = show_progress
        self.inputs = StaticInputs(self.buckets[-1], model_runner.device)
        self.staging = StagingArena(self.buckets[-1])
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.cost = CaptureCost()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def refusal(self, batch: ForwardBatch):
        if batch.forward_mode not in self.modes:
            return Refusal.MODE_NOT_CAPTURED
        # A verify's logits of every node come from the LM head after the body, as any row's.
        if batch.return_all_logits and batch.forward_mode != ForwardMode.TARGET_VERIFY:
            return Refusal.INPUT_LOGPROBS
        if batch.req_row_stride:  # rows between strided requests: no break writes them
            return Refusal.TOKENS_PER_REQUEST
        if batch.num_tokens > self.max_tokens:
            return Refusal.TOO_MANY_TOKENS
        return hidden_refusal(batch, self.hidden_mode, self.aux_layers)

    def capture(self) -> None:
        from tqdm import tqdm

        order = sorted(self.buckets, reverse=True)  # largest first: smaller ones reuse its blocks
        with self.cost.measure("piecewise graphs", len(order)):
            self._run_body(self._dummy_batch(order[0]))  # warm-up: lazy init, Triton compile
            for n in tqdm(order, desc="capturing piecewise graphs",
                          disable=not self.show_progress):
                self._capture_one(n)

    def _capture_one(self, n: int) -> None:
        batch = self._dummy_batch(n)
        graph = BreakableGraph()
        self.model_runner.attn_backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(batch, self.model_runner.attn_backend, n)):
            with breakable_capture(graph, self.pool, capture_stream(), self.staging):
                self.outputs[n] = self.model_runner.model(batch.input_ids, batch.positions,
                                                          self.aux_layers)
        self.graphs[n] = graph

    def _run_body(self, batch: ForwardBatch):
        with torch.cuda.stream(joined_capture_stream()):
            out = self.model_runner.forward_body(batch)
        torch.cuda.synchronize()
        return out

    def _dummy_batch(self, num_tokens: int) -> ForwardBatch:
        return self.inputs.pad_row_batch(self.model_runner.kv_cache, num_tokens,
                                         capture_hidden_mode=self.hidden_mode,
                                         aux_hidden_layers=self.aux_layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch):
        hidden, aux = self.replay_body(batch)
        return self.model_runner.postprocess(hidden, list(aux), batch)

    @torch.inference_mode()
    def replay_body(self, batch: ForwardBatch):
        """The body's replay alone: (hidden, aux) of the bucket, padded rows included (a later
        pipeline stage stops here: its outputs went on to the next stage inside the replay)."""
        n = pick_bucket(self.buckets, batch.num_tokens)
        padded = self.inputs.load(batch, n)
        attn = self.model_runner.attn_backend
        attn.init_forward_metadata(padded)
        with forward_context(ForwardContext(padded, attn, batch.num_tokens)):
            self.graphs[n].replay()
        return self.outputs[n]

    def info(self) -> dict:
        return {"num_buckets": len(self.graphs), "max_tokens": self.max_tokens,
                "modes": [m.name for m in self.modes],
                "hidden_mode": self.hidden_mode.name, "aux_layers": list(self.aux_layers),
                **self.cost.info(),
                "staging_memory_mb": round(self.staging.num_bytes / 2**20, 1)}
