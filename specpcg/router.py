"""The forward-mode router: for each ForwardBatch, a graph runner or eager, with a named reason.

Each runner declares what it captured (modes, hidden mode, aux layers, size limit) and answers
`refusal(batch) -> reason | None`; the router walks the candidates for the batch's mode and runs
the first that accepts. Every eager fallback is counted by (mode, runner, reason) and logged once.
"""

from __future__ import annotations

import logging
from collections import Counter

from specpcg.core import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

EAGER = "eager"


class Refusal:
    """Reasons a graph runner can give; the strings are what forward_stats reports."""

    GRAPHS_DISABLED = "graphs_disabled"
    MODE_NOT_CAPTURED = "mode_not_captured"
    TOO_MANY_TOKENS = "too_many_tokens"
    TOO_MANY_REQUESTS = "too_many_requests"
    HIDDEN_MODE_NOT_CAPTURED = "hidden_mode_not_captured"
    AUX_LAYERS_NOT_CAPTURED = "aux_layers_not_captured"
    INPUT_LOGPROBS = "input_logprobs"
    TOKENS_PER_REQUEST = "tokens_per_request_not_captured"
    TREE_MASK = "tree_mask_not_captured"
    # A mode whose graphs hold tree attention (a tree engine's verify, a head's tree steps)
    # got a batch without a tree mask.
    CHAIN_NOT_CAPTURED = "chain_verify_not_captured"


def hidden_refusal(batch: ForwardBatch, captured_mode, captured_aux: tuple):
    """A graph serves any request asking for no more hidden state than it captured."""
    if batch.capture_hidden_mode > captured_mode:
        return Refusal.HIDDEN_MODE_NOT_CAPTURED
    aux = batch.aux_hidden_layers  # most often the very layers captured: no sets built
    if aux != captured_aux and not set(aux) <= set(captured_aux):
        return Refusal.AUX_LAYERS_NOT_CAPTURED
    return None


def runner_writes_rows(runner, batch: ForwardBatch) -> bool:
    """Whether a graph runner writes a rows_pending batch's req_to_token rows itself."""
    writes = getattr(runner, "writes_rows", None)
    return writes is not None and writes(batch)


class ForwardRouter:
    def __init__(self, eager_runner, piecewise=None, decode=None, disabled_reasons=None):
        """eager_runner: ModelRunner. piecewise / decode: graph runners or None, in which case
        `disabled_reasons[name]` says why (reported as the fallback reason)."""
        self.eager_runner = eager_runner
        # Tensor / pipeline parallelism: tells the other ranks which graph a forward replays.
        self._announce = getattr(eager_runner, "before_forward", None)
        self.runners = {"piecewise": piecewise, "decode_graph": decode}
        self.disabled_reasons = dict(disabled_reasons or {})
        self.stats: Counter = Counter()
        self._logged: set = set()
        # Piecewise graphs serving decode modes (no full decode graph: tensor parallelism, an
        # attention backend no full graph holds); their refusals are the reasons reported.
        self._piecewise_decode = (["piecewise"] if ForwardMode.DECODE
                                  in getattr(piecewise, "modes", ()) else [])

    def candidates(self, mode: ForwardMode) -> list:
        if mode == ForwardMode.EXTEND:
            return ["piecewise"]
        if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return ["decode_graph"] + self._piecewise_decode
        if mode == ForwardMode.DRAFT_EXTEND:
            return ["decode_graph"]  # a head's tree steps, where captured
        return []

    def choose(self, batch: ForwardBatch) -> tuple:
        """(runner name, None) for a graph, or ("eager", reason)."""
        reason = Refusal.MODE_NOT_CAPTURED
        for name in self.candidates(batch.forward_mode):
            runner = self.runners[name]
            if runner is None:
                reason = self.disabled_reasons.get(name, Refusal.GRAPHS_DISABLED)
                continue
            reason = runner.refusal(batch)
            if reason is None:
                return name, None
        return EAGER, reason

    def forward(self, batch: ForwardBatch):
        name, reason = self.choose(batch)
        self.stats[(batch.forward_mode.name, name, reason or "")] += 1
        if name == EAGER:
            self._log_once(batch.forward_mode, reason)
            return self.eager_runner.forward(batch)
        runner = self.runners[name]
        if batch.rows_pending and not runner_writes_rows(runner, batch):
            self.eager_runner.kv_cache.write_rows(batch)  # before other ranks copy the rows
        if self._announce is not None:  # parallel ranks replay the same graph
            self._announce(batch, name)
        return runner.forward(batch)

    def count(self, mode: str, runner: str, reason=None, n: int = 1) -> None:
        """Records forwards run outside `forward` (a draft round's own graphs)."""
        self.stats[(mode, runner, reason or "")] += n

    def _log_once(self, mode: ForwardMode, reason) -> None:
        if (mode, reason) not in self._logged:
            self._logged.add((mode, reason))
            logger.info("%s runs eagerly: %s", mode.name, reason)

    def forward_stats(self) -> list:
        return [{"mode": m, "runner": r, "reason": why or None, "count": n}
                for (m, r, why), n in sorted(self.stats.items())]
