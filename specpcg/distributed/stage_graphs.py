"""Decode graphs of a pipeline stage: its layers, per micro-batch, as piecewise graphs.

Under pipeline parallelism a decode step or verify is cut into micro-batches so the stages
overlap (pipeline.micro_batches). A graph of the whole forward cannot keep that: it holds one
micro-batch's sends and receives. So each stage captures its own layers alone, per token-count
bucket, with hidden state, residual and aux-layer states in static buffers; the stage's Python
loop receives a micro-batch, copies it in, replays the bucket's graph and sends the outputs on.
The sends and receives stay eager between replays, and so do attention (a break: it reads the
live micro-batch's lengths) and, under tensor parallelism inside a stage, the all-reduces (breaks
too), so every collective goes through torch.distributed as it does eagerly.

Every rank cuts a batch the same way and applies the same rule (`serves`), so the ranks of one
stage replay or run eagerly together. Capture happens on every rank in the same order
(graphs.setup.build_graphs, in lockstep through TPDriver.build_graphs): a stage's all-reduce
breaks run during capture, and must meet their twins.
"""

from __future__ import annotations

import torch

from specpcg.core import ForwardBatch
from specpcg.distributed.pipeline import aux_before
from specpcg.forward_context import ForwardContext, forward_context, get_forward_context
from specpcg.graphs.breakable import (BreakableGraph, CaptureCost, breakable_capture,
                                      capture_stream, is_capturing, joined_capture_stream)
from specpcg.graphs.buckets import pick_bucket
from specpcg.graphs.piecewise_runner import DECODE_MODES, StaticInputs
from specpcg.graphs.staging import StagingArena


class StageGraphs:
    """One stage's layers (`stage._layers`) as a graph per token bucket, for DECODE and
    TARGET_VERIFY micro-batches that ask for exactly the captured aux layers."""

    def __init__(self, model_runner, buckets: list, aux_layers: tuple, pool,
                 show_progress: bool = True):
        stage = model_runner.model
        self.stage, self.model_runner = stage, model_runner
        self.buckets = sorted(buckets)
        self.aux_layers = tuple(aux_layers)
        self.pool, self.show_progress = pool, show_progress
        self.first = stage.stage == 0  # stage 0 starts from embeddings, with no residual
        n, dev = self.buckets[-1], model_runner.device
        like = stage.head_weight
        size = like.shape[-1]
        self.inputs = StaticInputs(n, dev)
        self.hidden = torch.zeros(n, size, dtype=like.dtype, device=dev)  # [max_tokens, H]
        self.residual = torch.zeros(n, size, dtype=like.dtype, device=dev)  # [max_tokens, H]
        self.aux_in = [torch.zeros(n, size, dtype=like.dtype, device=dev)
                       for _ in range(aux_before(self.aux_layers, stage.start))]  # [max_tokens, H]
        self.staging = StagingArena(n)
        self.graphs: dict = {}  # bucket -> BreakableGraph
        self.outputs: dict = {}  # bucket -> (hidden, residual, aux list)
        self.replays = 0
        self.cost = CaptureCost()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def serves(self, batch: ForwardBatch, num_tokens: int, aux_layers: tuple) -> bool:
        """Whether a micro-batch of `num_tokens` tokens of `batch` replays: the same answer on
        every rank, which sees the same batch."""
        return (not is_capturing() and batch.forward_mode in DECODE_MODES
                and not batch.req_row_stride and tuple(aux_layers) == self.aux_layers
                and num_tokens <= self.max_tokens and bool(self.graphs))

    def _body(self, n: int):
        aux = [a[:n] for a in self.aux_in]
        residual = None if self.first else self.residual[:n]
        hidden, residual = self.stage._layers(self.inputs.positions[:n], self.hidden[:n],
                                              residual, self.aux_layers, aux)
        return hidden, residual, aux

    def capture(self) -> None:
        from tqdm import tqdm

        order = sorted(self.buckets, reverse=True)  # largest first: smaller ones reuse its blocks
        attn = self.model_runner.attn_backend
        with self.cost.measure("pipeline stage graphs", len(order)):
            for i, n in enumerate(tqdm(order, desc=f"capturing stage {self.stage.stage} graphs",
                                       disable=not self.show_progress)):
                batch = self.inputs.pad_row_batch(self.model_runner.kv_cache, n)
                attn.init_forward_metadata(batch)
                with forward_context(ForwardContext(batch, attn, n)):
                    if i == 0:  # warm-up: lazy init and Triton compiles stay out of the capture
                        self._warm(n)
                    self.graphs[n], self.outputs[n] = self._record(n)

    def _warm(self, n: int) -> None:
        with torch.cuda.stream(joined_capture_stream()):
            self._body(n)
        torch.cuda.synchronize()

    def _record(self, n: int) -> tuple:
        graph = BreakableGraph()
        with breakable_capture(graph, self.pool, capture_stream(), self.staging):
            out = self._body(n)
        return graph, out

    @torch.inference_mode()
    def run(self, part: ForwardBatch, hidden, residual, aux: list) -> tuple:
        """The stage's layers on micro-batch `part` (its tokens' hidden, residual and aux
        states): (hidden, residual, aux) of its live tokens. Runs inside the forward's context,
        which it points at the padded micro-batch for the replay."""
        live = part.num_tokens
        n = pick_bucket(self.buckets, live)
        padded = self.inputs.load(part, n)  # ids, positions; padded tokens write to the sink
        self.hidden[:live].copy_(hidden)
        if residual is not None:
            self.residual[:live].copy_(residual)
        for buf, a in zip(self.aux_in, aux):
            buf[:live].copy_(a)
        ctx = get_forward_context()
        whole, whole_tokens = ctx.batch, ctx.num_tokens
        ctx.batch, ctx.num_tokens = padded, live
        try:
            ctx.attn_backend.init_forward_metadata(padded)
            self.graphs[n].replay()
        finally:
            ctx.batch, ctx.num_tokens = whole, whole_tokens
        self.replays += 1
        out_hidden, out_residual, out_aux = self.outputs[n]
        return out_hidden[:live], out_residual[:live], [a[:live] for a in out_aux]

    def info(self) -> dict:
        return {"stage": self.stage.stage, "num_buckets": len(self.graphs),
                "max_tokens": self.max_tokens, "modes": [m.name for m in DECODE_MODES],
                "aux_layers": list(self.aux_layers), "replays": self.replays, **self.cost.info()}
