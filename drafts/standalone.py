"""STANDALONE: a separate smaller model with the target's tokenizer drafts a chain.

It keeps its own KV cache. Each propose catches the draft up on the committed tokens it has not
seen (DRAFT_EXTEND, eager), then runs num_steps - 1 DECODE steps through its own decode CUDA
graphs (never piecewise graphs). After verify, its KV is cut back to what the target accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from drafts.base import DraftWorker, Proposal
from drafts.resume import ResumeCatchUp
from drafts.round import CatchUpPlan, RoundDrafting, roots_of
from drafts.wiring import build_round_runner, eager_rows, wire_draft_model
from specpcg.core import ForwardMode
from specpcg.sampler import target_probs
from specpcg.transfer import to_device

logger = logging.getLogger("specpcg")


@dataclass(eq=False)
class _DraftReq:
    rid: int
    req_pool_idx: int
    num_cached: int = 0  # committed tokens whose KV the draft holds


def check_draft_matches(target_cfg, target_tok, draft_cfg, draft_tok, path: str) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_draft_model_path {path!r}: draft vocab_size "
                         f"{draft_cfg.vocab_size} does not match the target's {target_cfg.vocab_size}")
    if target_tok is None or draft_tok is None:
        return
    probe = "The quick brown fox: 12 + 30 = 42, naïve café."
    if draft_tok.encode(probe) != target_tok.encode(probe):
        raise ValueError(f"speculative_draft_model_path {path!r}: the draft's tokenizer does not "
                         f"match the target's (they encode the same text differently)")


class StandaloneDraft(RoundDrafting, DraftWorker):
    name = "STANDALONE"

    def __init__(self, model, model_cfg, dtype, sharded_path=None):
        """Loaded, not yet wired: `setup` builds the KV cache and graphs once the target's KV
        budget is known (both caches share one memory budget, split by bytes per slot).
        sharded_path: the checkpoint of a draft sharded over the tensor ranks (`model` is rank
        0's shard, `model_cfg` its local shape), which the other ranks load their shards of."""
        self.model, self.model_cfg, self.dtype = model, model_cfg, dtype
        self.sharded_path, self.shards = sharded_path, 1
        self.kv_cache = self.runner = self.router = self.graphs = None
        self.round = None  # DraftGraphRunner: a chain round's catch-up and steps, a graph each
        self.resume = None  # drafts.resume.ResumeCatchUp: catching up on prompts, plain steps
        self._reqs: dict = {}  # rid -> _DraftReq

    @property
    def kv_bytes_per_slot(self) -> int:
        from specpcg.kv_cache import KVPool

        mc = self.model_cfg
        return KVPool.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)

    def setup(self, ctx) -> None:
        sharded = self.sharded_path is not None
        self.kv_cache, self.runner, self.router, self.graphs = wire_draft_model(
            self, ctx, parallel=ctx.parallel if sharded else None)
        if sharded:
            ctx.parallel.setup_draft(self.kv_cache, self.sharded_path)
            self.shards = ctx.config.tp_size
        elif ctx.spec.is_chain and self.runner.attn_backend.supports_row_stride:
            # The catch-up feeds at most the last draft and the bonus token.
            self.round = build_round_runner(self.runner, self.graphs, ctx.config,
                                            ctx.spec.num_steps, width=2)
            self.resume = ResumeCatchUp.build(self.runner, self.graphs, ctx.config,
                                              ctx.spec.num_steps + 1)

    def info(self) -> dict:
        return {"name": self.name, "tensor_parallel_shards": self.shards,
                **(self.graphs.info() if self.graphs else {}),
                "round_graphs": self.round.info() if self.round else None,
                "resume_graphs": self.resume.info() if self.resume else None}

    def _state(self, req) -> _DraftReq:
        st = self._reqs.get(req.rid)
        if st is None:
            st = self._reqs[req.rid] = _DraftReq(req.rid, self.kv_cache.new_request())
        return st

    def _forward(self, mode, states, new_ids):
        from specpcg.batch import alloc_batch

        batch = alloc_batch(self.kv_cache, mode, states, new_ids, self.runner.device)
        logits = self.router.forward(batch).logits
        for st, ids in zip(states, new_ids):
            st.num_cached += len(ids)
        return logits

    def propose(self, reqs: list, spec) -> Proposal:
        states = [self._state(r) for r in reqs]
        return self._propose_chain(reqs, states, spec)

    # -- RoundDrafting hooks -------------------------------------------------------------------
    def _catch_up_plan(self, reqs: list, states: list):
        """The graph's catch-up takes the committed tokens the draft has not seen (the bonus,
        and the last draft when all were accepted) when they fit its width."""
        ids = [r.ids_slice(st.num_cached) for r, st in zip(reqs, states)]  # >= the root
        return CatchUpPlan(ids) if max(len(x) for x in ids) <= self.round.width else None

    def _eager_catch_up(self, reqs: list, states: list):
        new_ids = [r.ids_slice(st.num_cached) for r, st in zip(reqs, states)]
        with eager_rows(self.runner):
            return self._forward(ForwardMode.DRAFT_EXTEND, states, new_ids), None

    def _caught_up(self, st: _DraftReq, num_tokens: int) -> None:
        st.num_cached += num_tokens

    def _chained(self, states: list, num_steps: int) -> None:
        for st in states:  # commit keeps the accepted ones of these drafts' KV
            st.num_cached += num_steps

    def _propose_steps(self, reqs, states, spec, logits, hidden=None, root=None) -> Proposal:
        """One DECODE batch per step (the decode graph): sampled requests draw their tokens
        from per-request generators on the host between steps."""
        columns, probs = [roots_of(reqs, logits.device) if root is None else root], []
        for step in range(spec.num_steps):
            token, q = draft_sample(logits, reqs)
            columns.append(token)
            probs.append(q)
            if step + 1 < spec.num_steps:
                logits = self._forward(ForwardMode.DECODE, states, [[t] for t in token.tolist()])
        return chain_proposal(columns, probs)

    def commit(self, reqs: list, accept_lens: list, hidden_paths=None) -> None:
        for req, m in zip(reqs, accept_lens):
            st = self._reqs[req.rid]
            # Called before the step's tokens are appended: all_ids still ends at the root.
            # The draft fed all_ids then d1..d_{k-1}; the accepted d1..dm stay valid.
            committed = req.seq_len
            keep = committed + min(m, st.num_cached - committed)
            self.kv_cache.truncate(st.req_pool_idx, keep)
            st.num_cached = keep

    def release(self, req) -> None:
        st = self._reqs.pop(req.rid, None)
        if st is not None:
            self.kv_cache.release(st.req_pool_idx)

    # -- overlapped rounds (specpcg/speculative/overlap.py) -------------------------------------
    @property
    def supports_overlap(self) -> bool:
        return self.round is not None

    def step_round(self, decode, max_requests: int):
        from drafts.step_round import StandaloneStepRound

        return StandaloneStepRound(self)

    def _as_verify(self, req) -> int | None:
        """The pending catch-up as the drafts a verify accepted (StandaloneStepRound turns
        that back into it): one token is m = 0, two are m = S (all); None: neither fits."""
        pending, drafts = req.seq_len - self._state(req).num_cached, self.round.steps + 1
        if pending == 1:
            return 0
        return drafts if pending == 2 and req.seq_len - 2 - drafts >= 0 else None

    def overlap_ready(self, reqs: list) -> bool:
        """Whether every request's catch-up is one verify's path (what a commit leaves)."""
        return all(self._as_verify(r) is not None for r in reqs)

    def can_catch_up_to_paths(self, reqs: list) -> bool:
        """The draft is not ahead of the target."""
        return all(self._state(r).num_cached <= r.num_cached for r in reqs)

    def catch_up_to_paths(self, reqs: list) -> None:
        """Feeds each request's tokens up to the target's KV (all but the root), so that its
        catch-up is the root alone (_as_verify's m = 0): speculation then resumes with an
        overlapped step, not a synchronous one (drafts/eagle.py, the same for heads)."""
        states = [self._state(r) for r in reqs]
        lead = [(st, r.ids_slice(st.num_cached, r.num_cached)) for r, st in zip(reqs, states)
                if st.num_cached < r.num_cached]
        if lead and self.resume is not None and self.resume.fits([len(i) for _, i in lead]):
            self.resume.run(self.kv_cache, self.router, [st.req_pool_idx for st, _ in lead],
                            [st.num_cached for st, _ in lead], [i for _, i in lead])
            for st, ids in lead:
                st.num_cached += len(ids)
        elif lead:
            self._forward(ForwardMode.DRAFT_EXTEND, [st for st, _ in lead], [i for _, i in lead])

    def device_path(self, reqs: list):
        """Each request's pending catch-up as a verify's path (_as_verify)."""
        from specpcg.speculative.overlap import DevicePath

        drafts, host = self.round.steps + 1, []
        for req in reqs:
            m = self._as_verify(req)
            first = req.seq_len - 2 - m  # the verify's prefix: the path ends at the root
            path = req.ids_slice(first + 1)
            host.append([first, m + 1, req.last_id] + path + [0] * (drafts + 1 - len(path)))
        ints = to_device(host, self.kv_cache.req_pool.req_to_token.device)
        return DevicePath(first_pos=ints[:, 0], lens=ints[:, 1], roots=ints[:, 2],
                          ids=ints[:, 3:], hidden=None)

    def draft_rows(self, reqs: list) -> list:
        return [self._state(r).req_pool_idx for r in reqs]

    def resolved(self, req, prefix: int, hidden_paths, row: int, m: int) -> None:
        """An overlapped step verified from `prefix` and accepted m: the draft holds the KV of
        the root and of the accepted drafts it fed."""
        self._reqs[req.rid].num_cached = prefix + 1 + min(m, self.round.steps)

    def trim(self, req) -> None:
        st = self._reqs[req.rid]
        self.kv_cache.truncate(st.req_pool_idx, st.num_cached)


def chain_proposal(columns: list, probs: list) -> Proposal:
    """columns: the root then each step's [bs] tokens; probs: each step's q ([bs, V]) or None."""
    draft_tokens = torch.stack(columns, dim=1)  # [bs, N]
    draft_probs = None
    if any(q is not None for q in probs):
        zero = torch.zeros_like(next(q for q in probs if q is not None))
        draft_probs = torch.stack([zero] + [zero if q is None else q for q in probs], 1)
    return Proposal(draft_tokens=draft_tokens, draft_probs=draft_probs)


def draft_sample(logits: torch.Tensor, reqs: list):
    """Greedy rows take the argmax; sampled rows draw from the draft's own filtered
    distribution q, returned ([bs, V], zeros for greedy rows) for rejection sampling."""
    token = logits.argmax(-1)
    sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    if not sampled:
        return token, None
    q = torch.zeros_like(logits, dtype=torch.float32)
    for i in sampled:
        q[i] = target_probs(logits[i], reqs[i].params)
        token[i] = torch.multinomial(q[i], 1, generator=reqs[i].generator)[0]
    return token, q


def load_standalone(ctx) -> "StandaloneDraft":
    """Loads the draft checkpoint and checks it matches the target (vocab and tokenizer)."""
    from specpcg.models.loading import draft_load_config, load_target

    path = ctx.spec.draft_model_path
    if not path:
        raise ValueError("speculative_draft_model_path is required for STANDALONE (a smaller "
                         "model with the target's tokenizer)")
    model, model_cfg, _ = load_target(draft_load_config(ctx.config, path), ctx.device,
                                      ctx.dtype)
    check_draft_matches(ctx.model_config, ctx.tokenizer, model_cfg,
                        _draft_tokenizer(path, ctx.tokenizer), path)
    tp = ctx.config.tp_size
    why_whole = shard_refusal(model_cfg, tp) if ctx.parallel is not None else "one process"
    if why_whole is None:  # every rank of rank 0's stage holds a shard and runs each forward
        from specpcg.distributed.shard import make_tp_model

        model, model_cfg = make_tp_model(model, model_cfg, 0, tp)
    elif tp > 1:
        logger.warning("the STANDALONE draft runs whole on rank 0: %s", why_whole)
    return StandaloneDraft(model, model_cfg, ctx.dtype, path if why_whole is None else None)


def shard_refusal(draft_cfg, tp: int):
    """Why a draft model is not sharded over `tp` tensor ranks (None: it is, like the target):
    one rank, or a shape the ranks cannot split (then it runs whole on rank 0)."""
    from specpcg.distributed.shard import check_tp

    if tp == 1:
        return "one tensor-parallel rank"
    try:
        check_tp(draft_cfg, tp)
    except ValueError as exc:
        return str(exc)
    return None


def _draft_tokenizer(path: str, target_tokenizer):
    """The draft's own tokenizer when it ships one (checked against the target's), else None."""
    if target_tokenizer is None:
        return None
    from specpcg.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except ValueError:
        return None  # weights only: the vocabulary size check is what can be made
