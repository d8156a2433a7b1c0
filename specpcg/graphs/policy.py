"""Which graphs an engine builds: the automatic disable rules, one named, logged reason each.

Piecewise graphs (EXTEND) are on by default on CUDA; decode graphs (DECODE, TARGET_VERIFY) too.
`enforce_piecewise_cuda_graph` skips the automatic rules (for tests) but not the user's own
`disable_*` switches or the absence of a GPU, which no rule can overcome.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphDecision:
    enabled: bool
    reason: str

    def as_dict(self) -> dict:
        return {"enabled": self.enabled, "reason": self.reason}


# Under tensor or pipeline parallelism every rank captures the same piecewise graphs in
# lockstep, with the collectives and the stage exchanges as eager breaks between segments (a
# torch.distributed collective captured inside a graph would replay without its host-side
# bookkeeping, and the ranks would stop agreeing on which one is in flight). A full decode
# graph has no breaks, so it cannot hold them; under TP alone the piecewise graphs serve decode
# (piecewise_serves_decode), under PP each stage's graphs of its own layers
# (stage_graphs_serve_decode).
TP_DECODE_REASON = ("tensor or pipeline parallelism: collectives and stage exchanges run "
                    "between graph segments, and a full decode graph has none (under tensor "
                    "parallelism alone, decode steps and verifies replay the piecewise graphs; "
                    "under pipeline parallelism, each stage's graphs of its own layers)")


def _piecewise_auto_rules(cfg) -> list:
    """(condition, reason) pairs; the first true condition disables piecewise graphs."""
    return [
        (cfg.piecewise_cuda_graph_max_tokens < 4,
         f"piecewise_cuda_graph_max_tokens={cfg.piecewise_cuda_graph_max_tokens} is below the "
         f"smallest bucket (4 tokens)"),
    ]


def decide_piecewise(cfg, device_type: str) -> GraphDecision:
    if cfg.disable_piecewise_cuda_graph:
        return _log(GraphDecision(False, "disable_piecewise_cuda_graph is set"), "piecewise")
    if cfg.disable_cuda_graph:
        return _log(GraphDecision(False, "disable_cuda_graph is set"), "piecewise")
    if device_type != "cuda":
        return _log(GraphDecision(False, f"no CUDA device (device is {device_type})"), "piecewise")
    if cfg.enforce_piecewise_cuda_graph:
        return _log(GraphDecision(True, "enforced by enforce_piecewise_cuda_graph"), "piecewise")
    for condition, reason in _piecewise_auto_rules(cfg):
        if condition:
            return _log(GraphDecision(False, reason), "piecewise")
    return _log(GraphDecision(True, "enabled by default on CUDA"), "piecewise")


def decide_decode_graph(cfg, device_type: str, attn_backend_name: str,
                        attn_supports_graph: bool, decode_only: bool = False) -> GraphDecision:
    """decode_only: the backend replays plain decode steps only, and the graphs asked for
    (a draft's) would run other modes too."""
    if cfg.disable_cuda_graph:
        return _log(GraphDecision(False, "disable_cuda_graph is set"), "decode")
    if device_type != "cuda":
        return _log(GraphDecision(False, f"no CUDA device (device is {device_type})"), "decode")
    if cfg.tp_size > 1 or cfg.pp_size > 1:
        return _log(GraphDecision(False, TP_DECODE_REASON), "decode")
    if not attn_supports_graph:
        # Piecewise graphs keep attention eager, so only full decode graphs need this.
        return _log(GraphDecision(False, f"attention backend {attn_backend_name!r} cannot be "
                                         f"captured in a full graph"), "decode")
    if decode_only:
        return _log(GraphDecision(False, f"attention backend {attn_backend_name!r} replays plain "
                                         f"decode steps only; a draft's rounds also extend"),
                    "decode")
    return _log(GraphDecision(True, "enabled by default on CUDA"), "decode")


def piecewise_serves_decode(piecewise: GraphDecision, decode: GraphDecision,
                            pp_size: int = 1) -> bool:
    """Whether the piecewise graphs also serve decode steps and verifies: where they are on and
    no full decode graph is (tensor parallelism, an attention backend that cannot be captured
    whole), a replay with eager breaks beats an eager forward. Not under pipeline parallelism:
    a piecewise graph is captured for one micro-batch, and an eager decode step cut into
    micro-batches keeps every stage busy. Not when the user turned graphs off."""
    return piecewise.enabled and not decode.enabled and pp_size == 1


def stage_graphs_serve_decode(piecewise: GraphDecision, pp_size: int) -> bool:
    """Whether each pipeline stage captures graphs of its own layers for decode steps and
    verifies (distributed/stage_graphs.py): under pipeline parallelism, wherever piecewise
    graphs are on. They replay per micro-batch, so the stages still overlap."""
    return piecewise.enabled and pp_size > 1


def _log(decision: GraphDecision, which: str) -> GraphDecision:
    logger.info("%s CUDA graphs %s: %s", which,
               "on" if decision.enabled else "off", decision.reason)
    return decision
