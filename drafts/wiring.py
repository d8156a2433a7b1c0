"""Builds a model draft's own KV cache, attention backend, runner, decode graphs and router."""

from __future__ import annotations

from dataclasses import replace

from specpcg.attention import create_attention_backend
from specpcg.core import CaptureHiddenMode
from specpcg.graphs.setup import build_graphs
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
from specpcg.model_runner import ModelRunner
from specpcg.router import ForwardRouter


def load_standalone(spec, engine):
    """Loads the draft checkpoint and checks it matches the target (vocab and tokenizer)."""
    from drafts.standalone import StandaloneDraft, check_draft_matches
    from specpcg.models.loading import load_target

    path = spec.draft_model_path
    if not path:
        raise ValueError("speculative_draft_model_path is required for STANDALONE (a smaller "
                         "model with the target's tokenizer)")
    cfg = replace(engine.config, model_path=path, load_format="auto", tokenizer_path=None,
                  skip_tokenizer_init=True)
    model, model_cfg, _ = load_target(cfg, engine.device, engine.dtype)
    check_draft_matches(engine.model_config, engine.tokenizer, model_cfg,
                        _draft_tokenizer(path, engine.tokenizer), path)
    return StandaloneDraft(model, model_cfg, engine.dtype)


def _draft_tokenizer(path: str, target_tokenizer):
    """The draft's own tokenizer when it ships one (checked against the target's), else None."""
    if target_tokenizer is None:
        return None
    from specpcg.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except ValueError:
        return None  # weights only: the vocabulary size check is what can be made


def wire_draft_model(draft, engine, hidden_mode=CaptureHiddenMode.NULL, extra_slots: int = 0):
    """extra_slots: room beyond the target's slot count for a draft round's own tokens."""
    mc, cfg = draft.model_cfg, engine.config
    slots = engine.kv_cache.total_slots + extra_slots
    pool = KVPool(slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype, engine.device)
    max_requests = engine.kv_cache.req_pool.pad_row
    kv_cache = KVCache(pool, ReqToTokenPool(max_requests, engine.context_len, engine.device))
    attn = create_attention_backend(cfg.attention_backend, engine.device, kv_cache, mc.num_heads,
                                    mc.num_kv_heads, mc.head_dim, mc.head_dim ** -0.5)
    runner = ModelRunner(draft.model, kv_cache, attn, engine.device)
    # Invariant 5: a draft never builds piecewise graphs, whatever the engine's setting.
    graphs = build_graphs(replace(cfg, disable_piecewise_cuda_graph=True), runner,
                          engine.context_len, hidden_mode=hidden_mode)
    reasons = {**graphs.disabled_reasons(), "piecewise": "drafts never build piecewise graphs"}
    router = ForwardRouter(runner, None, graphs.decode, reasons)
    return kv_cache, runner, router, graphs


def build_round_runner(runner, graphs, cfg, num_steps: int, target_hidden_size: int = 0,
                       width: int = 0):
    """A chain draft's round graphs over the same batch buckets as its decode graphs (captured
    into their pool), or, without decode graphs, the same bodies run eagerly. width: the most
    tokens a request's catch-up feeds (0: num_steps + 1, all a verify can accept)."""
    from specpcg.graphs.draft_runner import DraftGraphRunner

    decode = graphs.decode
    if decode is None:
        return DraftGraphRunner(runner, [cfg.max_running_requests], num_steps, target_hidden_size,
                                width=width, eager_reason=graphs.decode_decision.reason)
    rnd = DraftGraphRunner(runner, decode.buckets, num_steps, target_hidden_size, width=width,
                           pool=decode.pool, show_progress=cfg.show_progress)
    rnd.capture()
    return rnd
