"""Overlap scheduling for speculative steps: the host queues step n + 1 (draft round, verify,
accept) while step n's results are still on the device, and only then reads step n's tokens.

Step n + 1 is one replay of a graph (specpcg/speculative/step_graph.py) that reads step n's
results from static buffers: its draft catches up on step n's accepted path and its verify
starts where that path ends, both computed on the device, so the host never waits for a verify
before queuing the next one, and the device never idles while the host appends tokens, checks
stops and plans the next step. KV slots are read from req_to_token on the device: every request
keeps allocated, in the target's and the draft's cache, every position the steps in flight can
write (`_reserve`); `flush` gives back what was not used. A request that finished at step n
also ran step n + 1: those tokens are dropped with the request. Outputs are the synchronous
loop's, token for token: the same forwards run on the same inputs, only the host reads them one
step later.

Used for greedy chains of drafts that support it (heads with round graphs, and NGRAM, which
matches on the device) on an attention backend that plans from device tensors; the scheduler
falls back to the synchronous step (specpcg/speculative/loop.py) whenever the host must look
first: a request waiting for prefill, sampling or logprobs, a catch-up that is not one verify's
path and that the draft cannot bring to one (`catch_up_to_paths`: a head catches up on the
rows of the plain steps before it, bar the last, when the step starts), too few free KV slots.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from specpcg.speculative.depth import StepTimer
from specpcg.transfer import HostCopy, to_device


class DevicePath(NamedTuple):
    """Each request's accepted path of one verify, which the draft's next round catches up on;
    row i is request i, all on the device."""

    first_pos: torch.Tensor  # [n] position of ids[:, 0] in the draft (the verify's prefix)
    lens: torch.Tensor  # [n] tokens on the path: accepted drafts + the bonus
    roots: torch.Tensor  # [n] the path's last token (the next proposal's root)
    ids: Optional[torch.Tensor]  # [n, W] the path's tokens (W = num_draft_tokens), then
    # anything; None where the draft reads the step state itself (StepState.path)
    hidden: Optional[torch.Tensor]  # [n, W, H'] the target's hidden states on the path


class InflightSpec(NamedTuple):
    reqs: list  # the requests the step carried, in row order
    host: HostCopy  # [n, 2 + 2 W]: accept_len, bonus, the verify's nodes, their order
    width: int  # W: the nodes each request verified (a chain cut short at large batches)


class SpecOverlap:
    def __init__(self, scheduler, decoder, step_graphs):
        """step_graphs: a SpecStepGraphs (specpcg/speculative/step_graph.py)."""
        self.s, self.dec, self.draft = scheduler, decoder, decoder.draft
        self.graphs = step_graphs
        self.width = decoder.spec.num_draft_tokens
        self.is_chain = decoder.spec.is_chain
        # Positions past a verify's prefix a step writes: its N nodes, or a tree round's
        # branches in the draft's cache.
        self.reach = self.width + step_graphs.round.reach_extra
        self.inflight: Optional[InflightSpec] = None
        self._shortage = None  # usable()'s _shortfall, which the step it allows allocates
        self.num_steps = 0  # steps queued ahead of their results (server info)
        self.timer = StepTimer()  # each step's seconds, for the chain depth's choice

    # -- when ----------------------------------------------------------------------------------
    def usable(self) -> bool:
        """Whether the next speculative step can be queued ahead of the one in flight."""
        s, n = self.s, self.width
        reqs = s.running
        if s.waiting or not reqs or self.graphs.bucket(len(reqs)) is None:
            return False
        if any(r.return_logprob or not r.params.is_greedy for r in reqs):
            return False
        limit = min(s.kv_cache.req_pool.max_context_len, self.draft.overlap_context_len)
        if any(r.num_cached + 3 * n + self.reach > limit for r in reqs):  # _shortfall's reach
            return False
        prev = self.inflight
        # With no step in flight (after plain steps or a synchronous one) the draft may first
        # have to catch up as far as a graph's catch-up starts from (step does it); the slots
        # that takes are inside the shortfall, which counts from what the draft holds now.
        if prev is None and not (self.draft.overlap_ready(reqs)
                                 or self.draft.can_catch_up_to_paths(reqs)):
            return False
        target, draft = self._shortage = self._shortfall(reqs)
        if (sum(target[1]) > s.kv_cache.free_slots
                or (draft[0] and sum(draft[1]) > self.draft.kv_cache.free_slots)):
            return False
        if prev is None:
            return True
        carried = {id(r) for r in prev.reqs}
        return all(id(r) in carried for r in reqs)

    def _shortfall(self, reqs: list):
        """([req rows], [slots]) each cache lacks so that every request holds positions up to
        num_cached + N + reach: with its last step unread, a request's next verify starts at
        most N past num_cached and writes N more (a chain's draft round stays below that end
        too, a tree's branches reach further). Short requests take 2 N more at once, so most
        steps allocate nothing."""
        target, draft = ([], []), ([], [])
        draft_cache = self.draft.kv_cache  # None: a draft with no KV (NGRAM)
        for req, row in zip(reqs, self.draft.draft_rows(reqs)):
            end = req.num_cached + self.width + self.reach
            for cache, idx, out in ((self.s.kv_cache, req.req_pool_idx, target),
                                    (draft_cache, row, draft)):
                if cache is None:
                    continue
                short = end - cache.num_tokens(idx)
                if short > 0:
                    out[0].append(idx)
                    out[1].append(short + 2 * self.width)
        return target, draft

    def _reserve(self, reqs: list) -> None:
        """Allocates what usable() found short (it ran for these requests just before)."""
        target, draft = self._shortage
        if target[0]:
            self.s.kv_cache.extend_many(*target)
        if draft[0]:
            self.draft.kv_cache.extend_many(*draft)

    def catch_up(self, reqs: list) -> list:
        """With no speculative step in flight, brings the draft to the state a step starts
        from (overlap_ready). It needs only the tokens read so far, so the scheduler runs it
        before reading a plain step still in flight (the same positions, the same KV, whichever
        comes first), not after it with the device idle: then a look's switch step took 1.5-3.6
        ms more than the speculative step after it (H200, batch 1-16, NEXTN and EAGLE3,
        2beab0f; benchmarks/report_looks.py). Returns no finished request (the scheduler's fault
        boundary's form)."""
        self._caught_up(reqs)
        return []

    def _caught_up(self, reqs: list) -> bool:
        """Whether the draft had to catch up (catch_up_to_paths) to start a step from here."""
        if self.inflight is not None or self.draft.overlap_ready(reqs):
            return False
        self.draft.catch_up_to_paths(reqs)
        return True

    # -- a step ---------------------------------------------------------------------------------
    def step(self) -> tuple:
        """Queues one speculative step of every running request, then resolves the step before
        it. Returns (the requests that finished there, the tokens it emitted)."""
        s, prev, start = self.s, self.inflight, time.perf_counter()
        reqs = list(s.running)
        # Inside the scheduler's fault boundary. After plain steps the scheduler caught up
        # already (catch_up); here only after a prefill or a synchronous step.
        if self._caught_up(reqs):
            self._shortage = self._shortfall(reqs)
        self._reserve(reqs)
        bs = self.graphs.bucket(len(reqs))
        self._arrange(prev, reqs, bs)
        width = self.graphs.pick_width(bs)
        self.graphs.run(bs, width)
        if self.graphs.depth is not None:  # only a chain depth's choice reads step times
            measured = self.timer.launched(start, bs, width)
            if measured is not None:
                self.graphs.observe(*measured)
        self.num_steps += 1
        self.inflight = InflightSpec(reqs, HostCopy(self.graphs.state.out[width][:len(reqs)]),
                                     width)
        if prev is None:
            return s._collect_aborted(), 0
        finished, tokens = self._resolve(prev)
        return s._collect_aborted() + finished, tokens

    def _arrange(self, prev: Optional[InflightSpec], reqs: list, bs: int) -> None:
        """Puts request i's state in row i: from the host's view when no step is in flight,
        else by moving the rows of requests still running (those that finished dropped)."""
        g = self.graphs
        if prev is None:
            rows = to_device([[r.req_pool_idx for r in reqs], self.draft.draft_rows(reqs)],
                             self.s.device)
            g.state.seed(len(reqs), bs, rows, self.draft.device_path(reqs), g.pad_rows)
            return
        row = {id(r): i for i, r in enumerate(prev.reqs)}
        keep = [row[id(r)] for r in reqs]
        if keep == list(range(len(prev.reqs))):
            return
        g.state.keep(to_device(keep, self.s.device), bs, g.pad_rows)

    # -- reading a step -------------------------------------------------------------------------
    def _resolve(self, prev: InflightSpec) -> tuple:
        """Reads a step's results (the step's one blocking read) and applies them as the
        synchronous commit does. Returns (finished requests, tokens emitted)."""
        n = prev.width
        host = prev.host.tolist()
        hidden = self.graphs.state.hidden
        reqs, emitted = [], []
        for i, req in enumerate(prev.reqs):
            if req.finished:  # it finished (or was aborted) after this step was queued
                continue
            m, bonus, nodes = host[i][0], host[i][1], host[i][2:2 + n]
            prefix = req.num_cached
            if not self.is_chain:  # the step graph moved the path's KV first: so does the host
                self.s.kv_cache.reorder(req.req_pool_idx, prefix, host[i][2 + n:2 + 2 * n])
            req.num_cached = prefix + m + 1
            self.dec.record(req, m, n - 1 if self.is_chain else None)
            self.draft.resolved(req, prefix, hidden, i, m)
            reqs.append(req)
            emitted.append(nodes[1:m + 1] + [bonus])
        finished = self.s._append_and_finish(reqs, emitted)
        return finished, sum(len(e) for e in emitted)

    def flush(self) -> list:
        """Resolves the step in flight, if any, and gives back every slot reserved past what
        the requests hold; the synchronous loop then finds the state its own commit leaves."""
        prev, self.inflight = self.inflight, None
        self.timer.reset()
        if prev is None:
            return []
        finished, _ = self._resolve(prev)
        for req in self.s.running:
            self.s.kv_cache.truncate(req.req_pool_idx, req.num_cached)
            self.draft.trim(req)
        return finished

def spec_overlap_fits(decoder, attn_backend, parallel: bool) -> bool:
    """Whether an engine's speculative steps can overlap: a draft whose rounds load from the
    device, one process, and a target backend that plans from device tensors (and replays
    trees, for a tree)."""
    return (decoder.draft.supports_overlap and not parallel and attn_backend.plans_on_device
            and (decoder.spec.is_chain or attn_backend.supports_tree_graph))
