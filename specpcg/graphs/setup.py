"""Builds the graph runners an engine's configuration asks for, or says why it built none."""

from __future__ import annotations

import torch

from kernels import gemv
from specpcg.core import CaptureHiddenMode
from specpcg.graphs.buckets import decode_batch_buckets, piecewise_token_buckets
from specpcg.graphs.policy import (decide_decode_graph, decide_piecewise, piecewise_serves_decode,
                                   stage_graphs_serve_decode)


class GraphSet:
    """The runners (or None) and the decisions that produced them."""

    def __init__(self, piecewise, decode, piecewise_decision, decode_decision, stage=None):
        """stage: a pipeline stage's decode graphs of its own layers (StageGraphs), or None."""
        self.piecewise = piecewise
        self.decode = decode
        self.stage = stage
        self.piecewise_decision = piecewise_decision
        self.decode_decision = decode_decision

    def disabled_reasons(self) -> dict:
        return {"piecewise": self.piecewise_decision.reason,
                "decode_graph": self.decode_decision.reason}

    def info(self) -> dict:
        pcg = {**self.piecewise_decision.as_dict(),
               **(self.piecewise.info() if self.piecewise else {})}
        dec = {**self.decode_decision.as_dict(), **(self.decode.info() if self.decode else {})}
        out = {"piecewise_cuda_graph": pcg, "cuda_graph": dec}
        if self.stage is not None:
            out["pipeline_stage_graphs"] = self.stage.info()
        return out


def build_graphs(cfg, model_runner, context_len: int,
                 hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
                 aux_layers: tuple = (), num_verify_tokens: int = 0,
                 verify_tree: bool = False, draft_tree: tuple = (),
                 draft: bool = False) -> GraphSet:
    """hidden_mode / aux_layers: the most any forward of this engine will ask for (invariant 4).
    draft: the graphs of a draft model, whose rounds run more than plain decode steps."""
    from specpcg.graphs.decode_runner import DecodeGraphRunner
    from specpcg.graphs.piecewise_runner import PiecewiseRunner

    device = model_runner.device
    attn = model_runner.attn_backend
    pcg_decision = decide_piecewise(cfg, device.type)
    dec_decision = decide_decode_graph(cfg, device.type, attn.name, attn.supports_cuda_graph,
                                       decode_only=draft and attn.decode_graph_only)
    captures = pcg_decision.enabled or dec_decision.enabled
    pool = torch.cuda.graph_pool_handle() if captures else None
    if captures:
        gemv.prepare_capture(device)  # the piecewise warm-up's bucket is too wide for the kernel
    decode = piecewise = None
    # Piecewise first: its buckets are the larger ones, and a shared pool fills largest first.
    if pcg_decision.enabled:
        max_tokens = min(cfg.piecewise_cuda_graph_max_tokens, context_len)
        piecewise = PiecewiseRunner(model_runner, piecewise_token_buckets(max_tokens), hidden_mode,
                                    aux_layers, pool, cfg.show_progress,
                                    piecewise_serves_decode(pcg_decision, dec_decision,
                                                            cfg.pp_size))
        piecewise.capture()
    stage = None
    if stage_graphs_serve_decode(pcg_decision, cfg.pp_size):
        stage = _stage_graphs(cfg, model_runner, aux_layers, pool, num_verify_tokens)
    if dec_decision.enabled:
        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        decode = DecodeGraphRunner(model_runner, decode_batch_buckets(max_bs), hidden_mode,
                                   aux_layers, pool, num_verify_tokens, verify_tree,
                                   cfg.show_progress, draft_tree, write_rows=not draft)
        decode.capture()
    return GraphSet(piecewise, decode, pcg_decision, dec_decision, stage)


def _stage_graphs(cfg, model_runner, aux_layers: tuple, pool, num_verify_tokens: int):
    """This rank's pipeline stage graphs, captured and handed to its stage model. Buckets: up
    to the most tokens one micro-batch of a decode step or verify can hold."""
    from specpcg.distributed.stage_graphs import StageGraphs

    max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
    max_tokens = max(4, max_bs * max(1, num_verify_tokens))
    stage = StageGraphs(model_runner, piecewise_token_buckets(max_tokens), aux_layers, pool,
                        cfg.show_progress)
    stage.capture()
    model_runner.model.body_graphs = stage
    return stage


def capture_steps_then_decode(steps, decode, captures: bool):
    """Captures the speculative step graphs where `captures` (the draft's round graphs are
    captured) and the target's decode graphs exist, then, once step graphs are captured, the
    decode graphs once more (returns `steps`). Why: on an H200, a decode graph captured before
    the step graphs replayed its same kernels about 12% slower (wider gaps) than one captured
    after (docs/PERFORMANCE.md). Captured first as well: the step graphs' capture runs in
    inference mode, and buffers a backend makes on first use must not be made there (a later
    capture fills them in place)."""
    if decode is None or not captures:
        return steps
    steps.capture()
    if steps.graphs:
        decode.capture()
    return steps
