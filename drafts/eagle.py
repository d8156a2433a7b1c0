"""EAGLE, EAGLE3 and NEXTN: a one-layer draft head over the target's hidden states.

The target captures hidden states (FULL on prefill and verify; EAGLE3: three aux layers), and
hands them over: prefill chunks through `absorb`, the accepted path of each verify through
`commit`. Draft position p pairs the target's hidden state at p with token p + 1, so after a
verify that accepted m drafts the head catches up on m + 1 positions (DRAFT_EXTEND, with the
target's hidden states, which replace the draft's own guesses at those positions), then drafts:

- chain (topk 1): num_steps - 1 DECODE steps through the head's decode CUDA graphs, each
  feeding back the head's own output hidden state;
- tree (topk K): each step feeds the K best branches at once under a tree mask, expands each
  by its top K, keeps the K best by cumulative log-probability (EAGLE-2), and `build_tree`
  keeps the num_draft_tokens - 1 best nodes; every step and the selection replay as one graph
  (drafts/tree_round.py).

After verify the head's KV is cut back to the catch-up's end: the draft steps' KV is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from drafts.base import DraftWorker, Proposal
from drafts.plain_log import PlainSteps
from drafts.round import CatchUpPlan, RoundDrafting, roots_of
from specpcg.transfer import to_device
from drafts.standalone import chain_proposal, draft_sample
from drafts.tree_round import step_children
from drafts.resume import HiddenRows, ResumeCatchUp, gather_rows
from drafts.wiring import build_round_runner, eager_rows, wire_draft_model
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.hidden_ring import HiddenRing


@dataclass(eq=False)
class _HeadReq:
    req_pool_idx: int
    num_cached: int = 0  # head KV positions built from the target's hidden states
    pending: list = field(default_factory=list)  # target hidden rows for the next positions
    # When `pending` is exactly one verify's path: (that verify's [bs, N, H'] rows, our row).
    verified: Optional[tuple] = None


class _Row(NamedTuple):  # what make_batch reads of a request
    req_pool_idx: int
    num_cached: int


def load_head_draft(ctx) -> "HeadDraft":
    from drafts.head_checkpoint import load_head

    spec = ctx.spec
    if not spec.draft_model_path:
        raise ValueError(f"speculative_draft_model_path is required for {spec.algorithm} (a draft "
                         f"head checkpoint; `python -m drafts.train` makes one)")
    head, head_spec = load_head(spec.draft_model_path, spec.algorithm, ctx.model_config,
                                ctx.model, ctx.device, ctx.dtype)
    return HeadDraft(head, head_spec)


class HeadDraft(PlainSteps, RoundDrafting, DraftWorker):
    needs_hidden = CaptureHiddenMode.FULL

    def __init__(self, head, head_spec):
        self.name = head_spec.algorithm
        self.model, self.head_spec, self.model_cfg = head, head_spec, head_spec.layer_cfg
        # Our target records the residual stream *entering* a layer: layer i's output enters i+1.
        self.aux_layers = tuple(sorted(i + 1 for i in head_spec.aux_layer_ids))
        self.kv_cache = self.runner = self.router = self.graphs = None
        self.round = None  # DraftGraphRunner: a round's catch-up, then its steps, a graph each
        self.tree_round = None  # drafts.tree_round.TreeRound: a tree round's steps
        self.resume = None  # drafts.resume.ResumeCatchUp: catching up on prompts, plain steps
        self._reqs: dict = {}  # rid -> _HeadReq
        self._plain = None  # drafts/plain_log.py: plain steps' rows not yet handed over
        self.hidden_ring = None  # specpcg.hidden_ring.HiddenRing the target's plain steps fill

    @property
    def kv_bytes_per_slot(self) -> int:
        from specpcg.kv_cache import KVPool

        mc = self.model_cfg
        return KVPool.bytes_per_slot(1, mc.num_kv_heads, mc.head_dim, self.model.head_weight.dtype)

    def setup(self, ctx) -> None:
        spec = ctx.spec
        round_len = spec.topk * spec.num_steps  # a draft round's own tokens per request
        # A tree step reads every branch's hidden state: its graphs keep all rows.
        hidden = CaptureHiddenMode.LAST if spec.is_chain else CaptureHiddenMode.FULL
        self.kv_cache, self.runner, self.router, self.graphs = wire_draft_model(
            self, ctx, hidden, extra_slots=ctx.config.max_running_requests * round_len,
            tree=not spec.is_chain)
        if self.runner.attn_backend.supports_row_stride:
            width = ctx.model_config.hidden_size * max(1, len(self.aux_layers))
            # A tree's round: its catch-up (the accepted path's rows sit among the verify's
            # num_draft_tokens rows a request), then every tree step in one graph.
            if spec.is_chain:
                self.round = build_round_runner(self.runner, self.graphs, ctx.config,
                                                spec.num_steps, width)
            else:
                self.round = build_round_runner(
                    self.runner, self.graphs, ctx.config, 1, width, width=spec.num_draft_tokens,
                    round_slots=spec.topk * (spec.num_steps - 1),
                    add_kinds=lambda rnd: self._add_tree(rnd, spec))
            self.resume = ResumeCatchUp.build(self.runner, self.graphs, ctx.config,
                                              self.round.width, width)
        self.hidden_ring = HiddenRing.for_draft(ctx, len(self.aux_layers))

    def _add_tree(self, rnd, spec) -> None:
        from drafts.tree_round import TreeRound

        self.tree_round = TreeRound(self.model, rnd, spec.topk, spec.num_steps,
                                    spec.num_draft_tokens)

    def info(self) -> dict:
        return {"name": self.name, "aux_layer_ids": list(self.head_spec.aux_layer_ids),
                "needs_hidden": self.needs_hidden.name, "target_aux_layers": list(self.aux_layers),
                **(self.graphs.info() if self.graphs else {}),
                "round_graphs": self.round.info() if self.round else None,
                "resume_graphs": self.resume.info() if self.resume else None,
                "hidden_ring_depth": self.hidden_ring.depth if self.hidden_ring else None}

    # -- state ---------------------------------------------------------------------------------
    def _state(self, req) -> _HeadReq:
        st = self._reqs.get(req.rid)
        if st is None:
            st = self._reqs[req.rid] = _HeadReq(self.kv_cache.new_request())
        return st

    def absorb(self, req, hidden: torch.Tensor) -> None:
        # A copy: `hidden` may view a graph's output buffer that the next replay overwrites.
        self._state(req).pending.append(hidden.clone())

    def commit(self, reqs: list, accept_lens: list, hidden_paths=None) -> None:
        for i, (req, m) in enumerate(zip(reqs, accept_lens)):
            st = self._reqs[req.rid]
            self.kv_cache.truncate(st.req_pool_idx, st.num_cached)  # drop the draft steps' KV
            st.verified = (hidden_paths, i) if not st.pending else None
            st.pending.append(hidden_paths[i, :m + 1])

    def release(self, req) -> None:
        if self._plain is not None and req in self._plain.reqs:
            self._hand_over()  # the others' rows; a request back after preemption starts anew
        st = self._reqs.pop(req.rid, None)
        if st is not None:
            self.kv_cache.release(st.req_pool_idx)

    def _batch(self, mode, rows: list, new_ids: list, hidden, capture=CaptureHiddenMode.LAST,
               rows_pending: bool = True):
        """The new tokens' slots and their batch, hidden states as input (`alloc_batch`)."""
        from specpcg.batch import alloc_batch

        batch = alloc_batch(self.kv_cache, mode, rows, new_ids, self.runner.device, rows_pending)
        batch.input_hidden, batch.capture_hidden_mode = hidden, capture
        return batch

    def _eager_catch_up(self, reqs: list, states: list, head_rows: bool = False):
        """DRAFT_EXTEND over each request's positions with fresh target hidden states;
        returns the last position's logits [bs, V] (head_rows: the head's output rows [bs, H]
        instead, what a tree's root children come from) and output hidden state [bs, H]."""
        # One concatenation, not one per request (1.4 ms of host at batch 64, H200), and a copy
        # even of one piece: a piece may view a graph's output buffer.
        flat, new_ids = torch.cat([p for st in states for p in st.pending]), []
        for req, st in zip(reqs, states):
            n = sum(p.shape[0] for p in st.pending)
            st.pending, st.verified = [], None
            ids = req.ids_slice(st.num_cached + 1, st.num_cached + 1 + n)
            assert len(ids) == n, "target hidden states and tokens out of step"
            new_ids.append(ids)
        at = [_Row(s.req_pool_idx, s.num_cached) for s in states]
        with eager_rows(self.runner):
            hidden = self.model.project_target_hidden(flat)
            out = self.router.forward(self._batch(ForwardMode.DRAFT_EXTEND, at, new_ids, hidden))
        for st, ids in zip(states, new_ids):
            st.num_cached += len(ids)
        return out.hidden_states if head_rows else out.logits, out.aux_hidden_states[0]

    def propose(self, reqs: list, spec) -> Proposal:
        self._hand_over()
        states = [self._state(r) for r in reqs]
        if not spec.is_chain:
            bs = self.round.bucket(len(reqs)) if self.tree_round is not None else None
            if bs is not None:
                return self._propose_tree_round(reqs, states, bs)
            rows, hidden = self._eager_catch_up(reqs, states, head_rows=True)  # no round or bucket
            return self._propose_tree(states, roots_of(reqs, rows.device), rows, hidden, spec)
        return self._propose_chain(reqs, states, spec)

    # -- RoundDrafting hooks -------------------------------------------------------------------
    def _catch_up_plan(self, reqs: list, states: list):
        """The graph's catch-up needs every request's pending rows to be one verify's path
        (a verify's rows a request are the round's width)."""
        first = states[0].verified
        if first is None:
            return None
        for st in states:
            if st.verified is None or st.verified[0] is not first[0] or len(st.pending) != 1:
                return None
        ids = [req.ids_slice(st.num_cached + 1, st.num_cached + 1 + st.pending[0].shape[0])
               for req, st in zip(reqs, states)]
        return CatchUpPlan(ids, first[0], [st.verified[1] for st in states])

    def _caught_up(self, st: _HeadReq, num_tokens: int) -> None:
        st.num_cached += num_tokens
        st.pending, st.verified = [], None

    def _propose_steps(self, reqs, states, spec, logits, hidden, root=None) -> Proposal:
        """A chain one DECODE batch per step (the decode graph): sampled requests draw their
        tokens from per-request generators on the host between steps."""
        columns, probs = [roots_of(reqs, logits.device) if root is None else root], []
        steps = self._step_batches(states, spec.num_steps - 1, logits.device)
        for step in range(spec.num_steps):
            token, q = draft_sample(logits, reqs)
            columns.append(token)
            probs.append(q)
            if step + 1 < spec.num_steps:
                batch = steps(step, token, hidden)
                out = self.router.forward(batch)
                logits, hidden = out.logits, out.aux_hidden_states[0]
        return chain_proposal(columns, probs)

    def _step_batches(self, states: list, num_steps: int, device):
        """Allocates every chain step's slots at once and returns `make(step, token, hidden)`
        building that step's DECODE batch from device tensors: no host sync between steps."""
        if num_steps <= 0:
            return None
        idx = [s.req_pool_idx for s in states]
        slots = self.kv_cache.extend_many(idx, [num_steps] * len(states))
        base = [s.num_cached for s in states]
        host = torch.tensor([slots, [[b + j for j in range(num_steps)] for b in base]]).transpose(1, 2)
        # [2, steps, bs]: each step's slots and positions contiguous
        packed = to_device(host.contiguous(), device)
        rows = to_device(idx, device)
        ones = torch.ones(len(states), dtype=torch.long, device=device)

        def make(step: int, token, hidden) -> ForwardBatch:
            return ForwardBatch(
                forward_mode=ForwardMode.DECODE, input_ids=token, positions=packed[1, step],
                out_cache_loc=packed[0, step], req_pool_indices=rows,
                seq_lens=packed[1, step] + 1, extend_seq_lens=ones,
                seq_lens_cpu=[b + step + 1 for b in base], extend_seq_lens_cpu=[1] * len(base),
                capture_hidden_mode=CaptureHiddenMode.LAST, input_hidden=hidden)
        return make

    # -- overlapped rounds (specpcg/speculative/overlap.py) -------------------------------------
    @property
    def supports_overlap(self) -> bool:
        """A round runner (chain or tree): a round can then be loaded from device tensors."""
        return self.round is not None

    def step_round(self, decode, max_requests: int):
        """The head's part of an overlapped step: its round runner's catch-up, then its chain
        or its tree."""
        from drafts.step_round import HeadStepRound, HeadTreeStepRound

        return HeadStepRound(self) if self.tree_round is None else HeadTreeStepRound(self)

    def overlap_ready(self, reqs: list) -> bool:
        """Whether every request's catch-up is one verify's path (what commit leaves)."""
        self._hand_over()
        return self._catch_up_plan(reqs, [self._state(r) for r in reqs]) is not None

    def can_catch_up_to_paths(self, reqs: list) -> bool:
        """Every request has a pending row (plain steps and prefills leave them)."""
        self._hand_over()
        return all(self._state(r).pending for r in reqs)

    def catch_up_to_paths(self, reqs: list) -> None:
        """Catches up on all but each request's last pending row, and keeps that row as a
        one-row verify path: what an overlapped step's graph catches up on. After plain
        steps, speculation then resumes with an overlapped step where it ran one synchronous
        step first, whose host read and drained pipeline made it cost 7-30 ms against 1-2 ms
        steps (H200, batch 1-64, e6fbb0f). The catch-up replays graphs where it is short
        enough (drafts/resume.py), else it runs eagerly."""
        self._hand_over()
        states = [self._state(r) for r in reqs]
        flat, ends, counts = gather_rows([st.pending for st in states])
        lead = [(req, st, end - n, n - 1) for req, st, end, n in zip(reqs, states, ends, counts)
                if n > 1]
        if lead and self.resume is not None and self.resume.fits([n for *_, n in lead]):
            self.resume.run(
                self.kv_cache, self.router, [st.req_pool_idx for _, st, _, _ in lead],
                [st.num_cached for _, st, _, _ in lead],
                [req.ids_slice(st.num_cached + 1, st.num_cached + 1 + n)
                 for req, st, _, n in lead],
                HiddenRows(flat, [start for *_, start, _ in lead]))
            for _, st, _, n in lead:
                st.num_cached += n
        elif lead:
            for _, st, start, n in lead:
                st.pending = [flat[start:start + n]]
            self._eager_catch_up([req for req, *_ in lead], [st for _, st, _, _ in lead])
        last = flat.new_zeros(len(reqs), self.round.width, flat.shape[-1])
        last[:, 0] = flat.index_select(0, to_device([end - 1 for end in ends], flat.device))
        for i, st in enumerate(states):
            st.pending, st.verified = [last[i, :1]], (last, i)

    def device_path(self, reqs: list):
        """The requests' pending catch-up (one verify's path each) as a DevicePath."""
        from specpcg.speculative.overlap import DevicePath

        self._hand_over()
        states = [self._state(r) for r in reqs]
        plan = self._catch_up_plan(reqs, states)
        width = self.round.width
        host = [[st.num_cached, len(ids), req.last_id] + ids + [0] * (width - len(ids))
                for req, st, ids in zip(reqs, states, plan.ids)]
        ints = to_device(host, plan.verify_hidden.device)
        rows = to_device(plan.verify_rows, plan.verify_hidden.device)
        return DevicePath(first_pos=ints[:, 0], lens=ints[:, 1], roots=ints[:, 2],
                          ids=ints[:, 3:], hidden=plan.verify_hidden[rows])

    def draft_rows(self, reqs: list) -> list:
        return [self._state(r).req_pool_idx for r in reqs]

    def resolved(self, req, prefix: int, hidden_paths: torch.Tensor, row: int, m: int) -> None:
        """Host bookkeeping of an overlapped step whose verify started at `prefix` and
        accepted m drafts: its round caught up to prefix, and its path is pending."""
        st = self._reqs[req.rid]
        st.num_cached = prefix
        st.pending, st.verified = [hidden_paths[row, :m + 1]], (hidden_paths, row)

    def trim(self, req) -> None:
        """The overlap ended: give back the KV slots reserved past the caught-up positions."""
        st = self._reqs[req.rid]
        self.kv_cache.truncate(st.req_pool_idx, st.num_cached)

    # -- trees ---------------------------------------------------------------------------------
    def _propose_tree(self, states, root, rows, hidden, spec) -> Proposal:
        """EAGLE-2 expansion, one eager tree step at a time; proposals are a deterministic
        function of the context, so sampled requests verify target-only (no draft
        probabilities needed)."""
        from drafts.tree_round import expand_tree

        tokens, scores = self.model.top_children(rows, spec.topk)
        tree = expand_tree(root, tokens, scores, hidden, spec.num_steps, spec.num_draft_tokens,
                           lambda *a: self._tree_step(states, *a))
        return Proposal(draft_tokens=tree.draft_tokens, parents=tree.parents)

    def _propose_tree_round(self, reqs: list, states: list, bs: int) -> Proposal:
        """The tree round: the catch-up (its graph where the plan fits, else eager), then every
        tree step in the round's 'tree' graph."""
        tr = self.tree_round
        plan = self._catch_up_plan(reqs, states)
        if plan is None:
            rows, hidden = self._eager_catch_up(reqs, states, head_rows=True)
        _, caught = self._load_round(reqs, states, bs, plan, tr.round_slots)
        if caught is not None:
            rows, hidden = caught
        tokens, parents = tr.run(bs, rows, hidden, [st.num_cached for st in states])
        self.router.count("DRAFT_EXTEND", self.round.runner_name, self.round.eager_reason,
                          tr.num_steps - 1)
        return Proposal(draft_tokens=tokens, parents=parents)

    def _tree_step(self, states, tokens, branch_hidden, ancestors, s: int):
        """Feeds step s's K branches per request at position base + s - 1, each seeing the
        prefix and its own ancestors; returns its children (top_ids, top_logp [bs, K, K]) and
        hidden [bs, K, H]."""
        bs, k = tokens.shape
        rows = [_Row(st.req_pool_idx, st.num_cached + (s - 1) * k) for st in states]
        # Placeholder ids (the branches stay on the device); branches share a position: rows now.
        batch = self._batch(ForwardMode.DRAFT_EXTEND, rows, [[0] * k] * bs,
                            branch_hidden.reshape(bs * k, -1), CaptureHiddenMode.FULL, False)
        batch.input_ids = tokens.reshape(-1)
        base = to_device([st.num_cached for st in states], tokens.device)
        batch.positions = (base[:, None] + (s - 1)).expand(bs, k).reshape(-1).contiguous()
        batch.tree_mask = ancestors.contiguous()
        out = self.router.forward(batch)
        return (*step_children(self.model, out.hidden_states, bs, k),
                out.aux_hidden_states[0].view(bs, k, -1))
