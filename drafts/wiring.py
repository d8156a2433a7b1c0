"""Builds a model draft's own KV cache, attention backend, runner, decode graphs and router."""

from __future__ import annotations

from dataclasses import replace

from kernels.gemv import bucketed_rows, warm_row_buckets
from specpcg.attention import create_attention_backend
from specpcg.core import CaptureHiddenMode
from specpcg.graphs.setup import build_graphs
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
from specpcg.model_runner import ModelRunner
from specpcg.models.layers import BucketedLinear
from specpcg.router import ForwardRouter

WARM_CHUNKS = 4  # row buckets are warmed up to this many prefill chunks' tokens


def wire_draft_model(draft, ctx, hidden_mode=CaptureHiddenMode.NULL, extra_slots: int = 0,
                     tree: bool = False, parallel=None):
    """ctx: DraftContext with the target's kv_cache. extra_slots: room beyond the target's
    slot count for a draft round's own tokens. tree: the draft's tree steps get graphs of their
    own where the attention backend can replay trees (ctx.spec's topk and steps).
    parallel: the TPDriver of a draft sharded over the tensor ranks (None: whole on rank 0)."""
    mc, cfg = draft.model_cfg, ctx.config
    slots = ctx.kv_cache.total_slots + extra_slots
    pool = KVPool(slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, ctx.dtype, ctx.device)
    max_requests = ctx.kv_cache.req_pool.pad_row
    kv_cache = KVCache(pool, ReqToTokenPool(max_requests, ctx.context_len, ctx.device))
    attn = create_attention_backend(cfg.attention_backend, ctx.device, kv_cache, mc.num_heads,
                                    mc.num_kv_heads, mc.head_dim, mc.head_dim ** -0.5)
    announce = parallel.draft_announcer(kv_cache) if parallel is not None else None
    runner = ModelRunner(draft.model, kv_cache, attn, ctx.device, before_forward=announce)
    # Invariant 5: a draft never builds piecewise graphs, whatever the engine's setting. Under
    # tensor or pipeline parallelism a draft whole on rank 0 has no collective in its forward,
    # so the rule that keeps the target's full decode graphs off does not apply to it; a draft
    # sharded over the tensor ranks has collectives, so the rule does (its forwards run eagerly
    # on every rank of rank 0's stage).
    draft_tree = ((ctx.spec.topk, ctx.spec.num_steps) if tree and attn.supports_tree_graph
                  else ())
    layout = {} if parallel is not None else {"tp_size": 1, "pp_size": 1}
    graphs = build_graphs(replace(cfg, disable_piecewise_cuda_graph=True, **layout),
                          runner, ctx.context_len, hidden_mode=hidden_mode, draft_tree=draft_tree,
                          draft=True)
    reasons = {**graphs.disabled_reasons(), "piecewise": "drafts never build piecewise graphs"}
    router = ForwardRouter(runner, None, graphs.decode, reasons)
    if runner.device.type == "cuda":
        # The draft's eager catch-ups pad their rows to buckets (kernels/gemv.bucketed_rows):
        # each bucket's first GEMM is paid here, not by a request. A catch-up after a prefill
        # covers every prompt it admitted, a few chunks' worth.
        warm_row_buckets([m.weight for m in draft.model.modules()
                          if isinstance(m, BucketedLinear)], WARM_CHUNKS * cfg.chunked_prefill_size)
    return kv_cache, runner, router, graphs


def eager_rows(runner):
    """The context of a draft's eager catch-up: on CUDA its GEMMs pad their rows to buckets
    (kernels/gemv.bucketed_rows), which wire_draft_model warmed: a new row count each time."""
    return bucketed_rows(runner.device.type == "cuda")


def build_round_runner(runner, graphs, cfg, num_steps: int, target_hidden_size: int = 0,
                       width: int = 0, round_slots: int = 0, add_kinds=None, max_bs: int = 0):
    """A draft's round graphs over the same batch buckets as its decode graphs (captured into
    their pool), or, without decode graphs, the same bodies run eagerly. width: the most
    tokens a request's catch-up feeds (0: num_steps + 1, all a chain verify can accept);
    round_slots: see DraftGraphRunner; add_kinds(rnd): adds the draft's own kinds before
    capture; max_bs: only the buckets up to this many requests (0: all)."""
    from specpcg.graphs.draft_runner import DraftGraphRunner

    decode = graphs.decode
    kw = dict(width=width, round_slots=round_slots)
    if decode is None:
        most = min(cfg.max_running_requests, max_bs or cfg.max_running_requests)
        rnd = DraftGraphRunner(runner, [most], num_steps, target_hidden_size,
                               eager_reason=graphs.decode_decision.reason, **kw)
    else:
        buckets = [b for b in decode.buckets if not max_bs or b <= max_bs] or decode.buckets[:1]
        rnd = DraftGraphRunner(runner, buckets, num_steps, target_hidden_size,
                               pool=decode.pool, show_progress=cfg.show_progress, **kw)
    if add_kinds is not None:
        add_kinds(rnd)
    if decode is not None:
        rnd.capture()
    return rnd
