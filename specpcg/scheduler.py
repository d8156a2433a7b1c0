"""Continuous batching: prefill new requests (chunked under a token budget) while others decode.

Each `step` is schedule -> run -> sample -> finish. Prefill has priority, as in SGLang: a step runs
either an EXTEND batch (new prompts or prompt chunks) or a DECODE batch of all running requests.
When KV runs out during decode, the most recently admitted requests are preempted: their KV is
freed and they are re-prefilled later from prompt + output so far (greedy tokens do not change).
"""

from __future__ import annotations

import time
import logging
from collections import deque

import torch

from specpcg.batch import make_batch
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode, Request
from specpcg.overlap import OverlapDecode
from specpcg.sampler import record_input_logprobs, record_output_logprobs, sample
from specpcg.speculative.finish import Finish
from specpcg.speculative.overlap import SpecOverlap
from specpcg.speculative.shadow import ShadowVerify, accept_length
from specpcg.speculative.step_clock import StepClock
from specpcg.transfer import to_device

logger = logging.getLogger("specpcg")


class Scheduler:
    def __init__(self, runner, kv_cache, stop_checker, max_running_requests: int,
                 chunked_prefill_size: int, device: torch.device, spec=None,
                 overlap: bool = False, adaptive=None, min_prefill_requests: int = 1,
                 reserve_outputs: bool = False, spec_overlap=None):
        """spec: a SpecDecoder; with one, decode steps are speculative (propose/verify/...).
        overlap: plain decode steps run one ahead of their results (specpcg/overlap.py).
        spec_overlap: a SpecStepGraphs: with overlap, speculative steps run one ahead of
        their results too (specpcg/speculative/overlap.py); None: they do not.
        adaptive: with spec, an AdaptiveSpeculation that picks, step by step, speculative or
        plain decode steps by running-batch size (None: always speculative).
        min_prefill_requests: see EngineConfig.
        reserve_outputs: admit a request only while the KV cache holds every admitted request's
        whole output (enable_deterministic_inference), so none is ever preempted. A preempted
        request is re-prefilled through the extend kernel, whose reduction order differs from
        decode's, so in bf16 its later tokens could differ from a run where it kept its KV."""
        self.runner = runner
        self.spec = spec
        self.kv_cache = kv_cache
        self.stop_checker = stop_checker
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.min_prefill_requests = min_prefill_requests
        self.reserve_outputs = reserve_outputs
        # Slots a step writes past a request's last token: a verify's drafts, or one token.
        self.step_overshoot = spec.tokens_per_request if spec is not None else 1
        self.device = device
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0
        self.overlap = OverlapDecode(self) if overlap else None
        # Speculative steps queued one ahead of their results (specpcg/speculative/overlap.py).
        self.spec_overlap = (SpecOverlap(self, spec, spec_overlap)
                             if overlap and spec_overlap is not None else None)
        self.adaptive = adaptive
        # Adaptive speculation with a draft that can judge its drafts on the tokens plain steps
        # emit: its accept length without looking (specpcg/speculative/shadow.py).
        self.shadow = (ShadowVerify(spec.draft, spec.spec)
                       if adaptive is not None and spec is not None
                       and ShadowVerify.supported(spec.draft) else None)
        self._speculate = None  # adaptive: the next decode step's choice, made once per step
        self.clock = StepClock(self)  # each decode step's seconds, for the controller

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight())

    def _overlaps(self) -> list:
        return [ov for ov in (self.overlap, self.spec_overlap) if ov is not None]

    def _inflight(self) -> bool:
        """A decode step in flight that carries a request not finished yet."""
        return any(ov.inflight is not None and any(not r.finished for r in ov.inflight.reqs)
                   for ov in self._overlaps())

    def _overlap_kind(self):
        """Which overlapped step the next decode step can be: 'plain', 'spec' or None."""
        speculate = self._next_speculates()
        if self.overlap is not None and self.overlap.usable(plain=not speculate):
            return "plain"
        if speculate and self.spec_overlap is not None and self.spec_overlap.usable():
            return "spec"
        return None

    def step(self) -> list:
        """Runs one forward; returns the requests that finished in it (with overlap, those
        whose last token came from the step before)."""
        done, kind = [], self._overlap_kind()
        if kind == "spec" and self.overlap is not None and self.overlap.inflight is not None:
            reqs = list(self.running)  # the draft catches up while the plain step runs
            done += self._guarded(reqs, lambda: self.spec_overlap.catch_up(reqs))
        for name, ov in (("plain", self.overlap), ("spec", self.spec_overlap)):
            if ov is not None and ov.inflight is not None and kind != name:
                carried = list(ov.inflight.reqs)
                before = sum(len(r.output_ids) for r in carried)
                done += self._guarded(carried, ov.flush)  # the host's view first
                kind = self._overlap_kind()
                self.clock.flushed(name == "spec", carried, before)
        picked = self._schedule_prefill()
        if picked:
            self.clock.prefill()  # the draft first catches up on these prompts
            return done + self._guarded([r for r, _ in picked], lambda: self._run_prefill(picked))
        if self.running:
            run = {"plain": self._run_overlapped, "spec": self._run_spec_overlapped}.get(
                kind, self._run_decode)
            done += self._guarded(list(self.running), run)
            self.clock.step_done()
            self._shadow_verify()
        return done

    def _shadow_verify(self) -> None:
        """Shadow verifies on the tokens decoded so far (an overlapped step's host work, done
        while the device runs the step just launched), handed to adaptive speculation."""
        if self.shadow is None or not self.running:
            return
        depth, bs = None, len(self.running)
        graphs = self.spec_overlap.graphs if self.spec_overlap is not None else None
        if graphs is not None and graphs.depth is not None:
            depth = graphs.depth.current(graphs.bucket(bs))
        self.shadow.observe(self.running, depth)
        self.adaptive.shadow(accept_length(self.running))

    def _next_speculates(self) -> bool:
        """Whether the next decode step speculates: always with a draft and no adaptive
        speculation; with it, its choice for the running batch, asked once per decode step."""
        if self.spec is None or not self.running:
            return False
        bs, cap = len(self.running), self.spec.spec.disable_by_batch_size
        capped = cap is not None and bs > cap
        if self.adaptive is None:
            return not capped
        if self._speculate is None:
            if capped:  # no warm-up and no look above the cap: plain steps cost nothing extra
                self.adaptive.skip(bs)
            # Nothing waiting: the running batch is all there is, so finishing it is the goal.
            finish = None if self.waiting else self._finish_estimate
            behind = self._draft_lag
            # Where a batch of one is in its answer (shadow verifies follow that themselves).
            position = len(self.running[0].output_ids) if bs == 1 and self.shadow is None else None
            self._speculate = not capped and self.adaptive.use_spec(bs, finish, behind, position)
        return self._speculate

    def _finish_estimate(self) -> Finish:
        """The running batch's finish (use_spec's `finish`, asked within the step), each
        request's tokens left by the stop checker. NOTE: by max_new_tokens alone, requests
        ending at the context length seemed far from their end, and a batch thinning into an
        unmeasured bucket warmed it up at its tail every batch (`probe_controller_host.py`)."""
        checker, reqs = self.stop_checker, self.running
        left = None if checker is None else tuple(max(checker.tokens_left(r), 1) for r in reqs)
        return Finish.of(reqs, left, shadowed=self.shadow is not None)

    def _draft_lag(self):
        """The positions the draft would catch up on (use_spec's `behind`)."""
        return self.spec.draft.catch_up_positions(self.running)

    def _guarded(self, carried: list, run) -> list:
        """run(), or, when the forward raises, exactly the requests it carried finished with
        the error and their KV freed; every other request goes on as if nothing happened."""
        try:
            return run()
        except Exception as exc:  # NOTE: a fault boundary: the engine must keep serving
            for ov in self._overlaps():
                ov.inflight = None  # its requests are among those ended below
            if getattr(exc, "fatal", False):  # the engine itself cannot go on
                raise
            logger.exception("a forward failed; ending the %d request(s) it carried", len(carried))
            message = f"{type(exc).__name__}: {exc}"
            for req in carried:
                self._end(req, {"type": "error", "message": message})
            return carried

    def abort(self, rid: int):
        """Ends request `rid` wherever it is (waiting or running) and frees its KV; returns
        it, or None when no such request is in flight."""
        for req in list(self.waiting) + self.running:
            if req.rid == rid and not req.finished:
                self._end(req, {"type": "abort", "message": "aborted"})
                return req
        return None

    def _end(self, req: Request, reason: dict) -> None:
        req.finish_reason, req.finished_at = reason, time.perf_counter()
        if req.req_pool_idx is not None:
            self._release(req)
        self.waiting = deque(r for r in self.waiting if r is not req)
        self.running = [r for r in self.running if r is not req]

    # -- prefill -------------------------------------------------------------------------------
    def _admission_waits(self) -> bool:
        """Whether new requests wait for more free slots (a prompt mid-chunk never waits)."""
        if not self.running or not self.waiting or self.waiting[0].req_pool_idx is not None:
            return False
        free = self.max_running_requests - len(self.running)
        return free < min(self.min_prefill_requests, len(self.waiting))

    def _schedule_prefill(self) -> list:
        budget, picked = self.chunked_prefill_size, []
        if self._admission_waits():
            return picked
        while self.waiting and budget > 0:
            req = self.waiting[0]
            new_row = req.req_pool_idx is None
            if new_row and len(self.running) + len(picked) >= self.max_running_requests:
                break
            chunk_len = min(req.seq_len - req.num_cached, budget)
            # Keep one slot per running request free for its next decode token.
            reserve = len(self.running) + len(picked) + 1
            pending = self.chunked_prefill_size - budget  # picked, not yet allocated
            if not self.kv_cache.can_fit(pending + chunk_len + reserve) and (self.running or picked):
                break
            if self.reserve_outputs and (self.running or picked) and not self._outputs_fit(
                    [r for r, _ in picked] + [req]):
                break
            self.waiting.popleft()
            if new_row:
                req.req_pool_idx = self.kv_cache.new_request()
            picked.append((req, chunk_len))
            budget -= chunk_len
        if picked:  # the prefill's forward writes req_to_token from its batch (rows_pending)
            self.kv_cache.extend_many([r.req_pool_idx for r, _ in picked], [n for _, n in picked],
                                      write=False)
        return picked

    def _slots_to_come(self, req: Request) -> int:
        """KV slots `req` may still take: the rest of its prompt and of its outputs, and what
        one step writes past its last token."""
        total = len(req.prompt_ids) + req.params.max_new_tokens + self.step_overshoot
        return max(total - req.num_cached, 0)

    def _outputs_fit(self, admitting: list) -> bool:
        """Whether the free slots hold what every running and `admitting` request may still
        take (reserve_outputs)."""
        need = sum(self._slots_to_come(r) for r in self.running + admitting)
        return need <= self.kv_cache.free_slots

    def _run_prefill(self, picked: list) -> list:
        reqs = [r for r, _ in picked]
        starts = [r.num_cached for r in reqs]
        new_ids = [r.ids_slice(s, s + n) for (r, n), s in zip(picked, starts)]
        batch = make_batch(self.kv_cache, ForwardMode.EXTEND, reqs, new_ids, self.device,
                           rows_pending=True)
        batch.return_all_logits = any(r.wants_input_logprobs for r in reqs)
        draft = self.spec.draft if self.spec is not None else None
        if draft is not None:
            batch.capture_hidden_mode, batch.aux_hidden_layers = draft.needs_hidden, draft.aux_layers
        out = self.runner.forward(batch)
        hidden = draft.target_hidden(out) if draft is not None and draft.needs_hidden else None
        done, chunked, row = [], [], 0
        for (req, chunk_len), start in zip(picked, starts):
            if hidden is not None:
                draft.absorb(req, hidden[row:row + chunk_len])
            req.num_cached += chunk_len
            if req.wants_input_logprobs and start < len(req.prompt_ids):
                record_input_logprobs(req, out.all_logits[row:row + chunk_len], start)
            row += chunk_len
            (done if req.num_cached == req.seq_len else chunked).append(req)
        self.waiting.extendleft(reversed(chunked))
        last = to_device([reqs.index(r) for r in done], self.device)
        return self._sample_and_finish(done, out.logits[last] if done else None)

    # -- decode --------------------------------------------------------------------------------
    def _run_overlapped(self) -> list:
        """A plain decode step launched ahead of its results (specpcg/overlap.py), timed for
        adaptive speculation: in steady state a call lasts one device step."""
        start, bs = time.perf_counter(), len(self.running)
        self._speculate = None
        resolves = self.overlap.inflight is not None  # else this call only launches
        finished = self.overlap.step()
        if resolves:
            self.clock.record(bs, False, bs, start)
        self.clock.launched_only = not resolves
        return finished

    def _run_spec_overlapped(self) -> list:
        """A speculative step queued ahead of its results (specpcg/speculative/overlap.py);
        timed, like a plain one, by the step it resolves."""
        start, bs = time.perf_counter(), len(self.running)
        self._speculate = None
        finished, tokens = self.spec_overlap.step()
        if tokens:
            self.clock.record(bs, True, tokens, start)
        self.clock.launched_only = not tokens
        return finished

    def _run_decode(self) -> list:
        speculate = self._next_speculates()
        self._speculate = None
        self._make_room_for_decode(self.spec.tokens_per_request if speculate else 1)
        if not self.running:
            return self._collect_aborted()
        reqs, start = list(self.running), time.perf_counter()
        if speculate:
            emitted = self.spec.step(reqs)
            tokens = sum(len(e) for e in emitted)
            finished = self._append_and_finish(reqs, emitted)
        else:
            finished, tokens = self._plain_decode(reqs), len(reqs)
        self.clock.record(len(reqs), speculate, tokens, start)
        return finished

    def _plain_decode(self, reqs: list) -> list:
        """One token per request (plain_forward), sampled and appended now."""
        self.kv_cache.extend_many([r.req_pool_idx for r in reqs], [1] * len(reqs), write=False)
        batch = make_batch(self.kv_cache, ForwardMode.DECODE, reqs, [[r.last_id] for r in reqs],
                           self.device, rows_pending=True)
        out = self.plain_forward(batch, reqs)
        self.count_plain_tokens(reqs)
        return self._sample_and_finish(reqs, out.logits, out.greedy_ids)

    def count_plain_tokens(self, reqs: list) -> None:
        """With a draft, a plain step's token is not a speculative one (spec_meta tells them
        apart); without one there is nothing to tell apart."""
        if self.spec is not None:
            for req in reqs:
                req.plain_decode_tokens += 1

    def plain_forward(self, batch: ForwardBatch, reqs: list):
        """A DECODE forward of one token per request. With a draft that reads the target's
        hidden states they are captured and handed over (in row order), so the draft can catch
        up when speculation resumes; each request's num_cached moves past its token."""
        draft = self.spec.draft if self.spec is not None else None
        capture = draft is not None and draft.needs_hidden != CaptureHiddenMode.NULL
        if capture:
            batch.capture_hidden_mode, batch.aux_hidden_layers = draft.needs_hidden, draft.aux_layers
        out = self.runner.forward(batch)
        if capture and out.hidden_in_ring:  # the step wrote them where the draft reads them
            draft.absorb_ring(reqs)
        elif capture:
            draft.absorb_rows(reqs, draft.target_hidden(out, own=True))
        for req in reqs:
            req.num_cached += 1
        return out

    def _make_room_for_decode(self, tokens_per_request: int) -> None:
        while self.running and self.kv_cache.free_slots < tokens_per_request * len(self.running):
            victim = self.running.pop()  # most recently admitted
            self._release(victim)
            victim.num_cached = 0
            victim.num_preemptions += 1
            self.num_preemptions += 1
            if victim.seq_len + tokens_per_request > self.kv_cache.total_slots:
                # It can never fit again: finish it instead of looping forever.
                victim.finish_reason = {"type": "abort", "message": "KV cache is full"}
                victim.finished_at = time.perf_counter()
                self.waiting.append(victim)  # collected as finished by _collect_aborted
            else:
                self.waiting.appendleft(victim)

    # -- sample and finish ---------------------------------------------------------------------
    def _sample_and_finish(self, reqs: list, logits, greedy_ids=None) -> list:
        finished = self._collect_aborted()
        if not reqs:
            return finished
        next_ids = sample(logits, reqs, greedy_ids)
        record_output_logprobs(logits, next_ids, reqs)
        return finished + self._append_and_finish(reqs, [[t] for t in next_ids.tolist()])

    def _append_and_finish(self, reqs: list, new_tokens: list) -> list:
        """Appends each request's new tokens one by one, stopping where it finishes (EOS or
        max_new_tokens inside an accepted run drops the rest); releases finished requests."""
        finished, now = [], time.perf_counter()
        running_ids = {id(r) for r in self.running}
        for req, tokens in zip(reqs, new_tokens):
            req.first_token_at = req.first_token_at or now
            self.stop_checker.append(req, tokens)
            if req.return_logprob:  # tokens cut by EOS or max_new_tokens lose theirs too
                del req.output_logprobs[len(req.output_ids):]
            if req.finished:
                req.finished_at = now
                self._release(req)
                finished.append(req)
                if self.adaptive is not None:  # its accept length, for the finish estimate
                    self.adaptive.finished(req)
            elif id(req) not in running_ids:
                self.running.append(req)
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _release(self, req: Request) -> None:
        self.kv_cache.release(req.req_pool_idx)
        req.req_pool_idx = None
        if self.spec is not None:
            self.spec.draft.release(req)

    def _collect_aborted(self) -> list:
        aborted = [r for r in self.waiting if r.finished]
        if aborted:
            self.waiting = deque(r for r in self.waiting if not r.finished)
        return aborted
