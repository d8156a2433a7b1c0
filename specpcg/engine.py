"""Engine: the public entry point. Wires model, KV cache, attention, runner and scheduler."""

from __future__ import annotations

import logging
import threading
import time

import torch

from specpcg.attention import create_attention_backend
from specpcg.config import EngineConfig
from specpcg.inputs import build_requests, normalize_inputs
from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
from specpcg.graphs.setup import build_graphs, capture_steps_then_decode
from specpcg.model_runner import ModelRunner
from specpcg.models.loading import load_target
from specpcg.router import ForwardRouter
from specpcg.sampler import make_generator
from specpcg.speculative.config import SpecConfig
from specpcg.speculative.loop import SpecDecoder, spec_meta
from specpcg.speculative.overlap import spec_overlap_fits
from specpcg.speculative.registry import DraftContext, create_draft
from specpcg.scheduler import Scheduler
from specpcg.stopping import StopChecker, trim_stop_string

logger = logging.getLogger("specpcg")
CPU_DEFAULT_KV_TOKENS = 32768


def freeze_startup_objects() -> None:
    """Moves every object alive after startup (the imports, the model, the graphs) out of the
    garbage collector's reach. A full collection walks every tracked object: with the
    libraries loaded (a tiny model's CPU engine) 419,580 objects, 0.22 s, against 0.0004 s
    frozen (benchmarks/probe_gc.py). Python runs one whenever the objects that survived
    younger collections pass a quarter of those tracked, and it pauses the whole engine.
    Engine.shutdown unfreezes them so its model can be collected, and so does exit."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    if not getattr(freeze_startup_objects, "registered", False):
        atexit.register(gc.unfreeze)  # exit's final collection may then free them all
        freeze_startup_objects.registered = True


class Engine:
    def __init__(self, **kwargs):
        self.config = cfg = EngineConfig.from_kwargs(kwargs)
        logging.basicConfig(level=cfg.log_level.upper())
        self.spec = SpecConfig.resolve(cfg) if cfg.speculative_algorithm else None
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(self.device)
        t0 = time.perf_counter()
        self.tp = self._draft_target = None  # set by _load_parallel_shard
        self._thread = None  # async_generate's engine thread, started on first use
        self._lock = threading.RLock()  # one step, submit or abort at a time, any thread
        if cfg.node_rank > 0:
            raise ValueError(f"node_rank={cfg.node_rank}: the engine runs on node 0; node "
                             f"{cfg.node_rank} runs its ranks with `python -m specpcg serve "
                             f"--nnodes {cfg.nnodes} --node-rank {cfg.node_rank} "
                             f"--dist-init-addr HOST:PORT ...` (distributed.worker.run_node)")
        if cfg.tp_size > 1 or cfg.pp_size > 1:
            self.model, self.model_config, self.tokenizer = self._load_parallel_shard(cfg)
        else:
            self.model, self.model_config, self.tokenizer = load_target(cfg, self.device,
                                                                        self.dtype)
        self.load_time_s = time.perf_counter() - t0
        if cfg.enable_deterministic_inference:
            from specpcg.models.deterministic import make_batch_invariant

            make_batch_invariant(self.model)
        mc = self.model_config
        self.context_len = min(cfg.context_length or mc.max_position_embeddings,
                               mc.max_position_embeddings)
        # Under TP/PP a draft borrows the whole embedding and LM head, not rank 0's shard.
        target = self._draft_target or self.model
        self.draft_ctx = DraftContext(self.spec, cfg, target, target.config, self.tokenizer,
                                      self.device, self.dtype,
                                      self.context_len, parallel=self.tp) if self.spec else None
        self.draft = create_draft(self.draft_ctx) if self.spec else None
        self.kv_cache = self._make_kv_cache(getattr(self.draft, "kv_bytes_per_slot", 0))
        self.attn_backend = create_attention_backend(
            cfg.attention_backend, self.device, self.kv_cache, mc.num_heads, mc.num_kv_heads,
            mc.head_dim, mc.head_dim ** -0.5, verify_kernel=cfg.resolve_verify_kernel())
        if self.tp is not None:
            self.tp.setup(self.kv_cache)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attn_backend, self.device,
                                  before_forward=self.tp.before_forward if self.tp else None)
        self.spec_decoder = self._setup_spec() if self.spec else None
        # Before any graph is captured: the target's DECODE graphs write a head's hidden rows.
        self.runner.hidden_ring = getattr(self.draft, "hidden_ring", None)
        needs = self._graph_needs()
        if self.tp is not None:
            self.tp.build_graphs(self.context_len, needs)
        self.graphs = build_graphs(cfg, self.runner, self.context_len, **needs)
        self.router = ForwardRouter(self.runner, self.graphs.piecewise, self.graphs.decode,
                                    self.graphs.disabled_reasons())
        if self.spec_decoder is not None:
            self.spec_decoder.router = self.router
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        # Verify writes N positions past the last token: stop early enough to leave them room.
        room = self.spec.num_draft_tokens if self.spec else 1
        self.stop_checker = StopChecker(self.tokenizer, tuple(eos), self.context_len - room + 1)
        self.scheduler = Scheduler(self.router, self.kv_cache, self.stop_checker,
                                   cfg.max_running_requests, cfg.chunked_prefill_size, self.device,
                                   self.spec_decoder, overlap=not cfg.disable_overlap_schedule,
                                   adaptive=self._adaptive(),
                                   min_prefill_requests=cfg.min_prefill_requests,
                                   reserve_outputs=cfg.enable_deterministic_inference,
                                   spec_overlap=self._spec_step_graphs())
        self._stats = {"num_requests": 0, "num_generated_tokens": 0}
        self.rank_reports = self.tp.reports(cfg, self.graphs, self.device) if self.tp else None
        freeze_startup_objects()

    def _load_parallel_shard(self, cfg):
        """Starts ranks 1.. (specpcg/distributed) and keeps rank 0's part of the target."""
        from specpcg.distributed.group import free_init_addr
        from specpcg.distributed.shard import FullVocabView
        from specpcg.distributed.worker import TPDriver, check_parallel, shard_of

        full, full_cfg, tokenizer = load_target(cfg, self.device, self.dtype)
        check_parallel(cfg, full_cfg)  # refused before any other process starts
        self.tp = TPDriver(cfg, cfg.dist_init_addr or free_init_addr())
        model, local = shard_of(full, full_cfg, cfg, 0)
        self._draft_target = FullVocabView(full)
        self._draft_target.config = full_cfg  # drafts see the whole target's shape
        return model, local, tokenizer

    def _setup_spec(self) -> SpecDecoder:
        if not self.spec.is_chain and not self.attn_backend.supports_tree_mask:
            raise ValueError(f"speculative_eagle_topk={self.spec.topk} drafts trees, which "
                             f"attention_backend {self.attn_backend.name!r} cannot attend: use "
                             f"'triton' or 'torch'")
        if hasattr(self.draft, "setup"):
            self.draft_ctx.kv_cache = self.kv_cache
            self.draft.setup(self.draft_ctx)
        return SpecDecoder(self.draft, None, self.kv_cache, self.spec, self.device)

    def _spec_step_graphs(self):
        """The overlapped speculative step's graphs (captured when the target's decode graphs
        and the draft's round graphs are), or None when speculative steps cannot overlap."""
        from specpcg.speculative.step_graph import SpecStepGraphs

        cfg, dec = self.config, self.spec_decoder
        if (dec is None or cfg.disable_overlap_schedule
                or not spec_overlap_fits(dec, self.attn_backend, self.tp is not None)):
            return None
        decode = self.graphs.decode
        step_round = self.draft.step_round(decode, cfg.max_running_requests)
        steps = SpecStepGraphs(dec, self.runner, step_round, decode.pool if decode else None,
                               cfg.show_progress, not cfg.disable_adaptive_speculation)
        return capture_steps_then_decode(steps, decode, step_round.captures)

    def _adaptive(self):
        """Adaptive speculation, unless pinned off or the acceptance is simulated (a benchmark
        of the speculative path itself: plain steps would dilute what it measures)."""
        from specpcg.speculative.adaptive import AdaptiveSpeculation

        if (self.spec is None or self.config.disable_adaptive_speculation
                or self.spec.simulate_accept_prob is not None):
            return None
        return AdaptiveSpeculation()

    def _graph_needs(self) -> dict:
        """What the target's graphs must capture for the active draft (invariant 4)."""
        if self.spec is None:
            return {}
        # A tree's verify needs a backend that builds node rows from a static mask; every
        # verify needs one that replays more than plain decode steps. Else verifies run eagerly.
        tree, attn = not self.spec.is_chain, self.attn_backend
        graphs = (not tree or attn.supports_tree_graph) and not attn.decode_graph_only
        return {"hidden_mode": self.draft.needs_hidden, "aux_layers": self.draft.aux_layers,
                "num_verify_tokens": self.spec.num_draft_tokens if graphs else 0,
                "verify_tree": tree and graphs}

    def _make_kv_cache(self, draft_bytes_per_slot: int = 0) -> KVCache:
        mc, cfg = self.model_config, self.config
        per_slot = KVPool.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        per_slot += draft_bytes_per_slot  # a model draft keeps one slot per target slot
        if self.device.type == "cuda":
            free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
            budget = free_bytes - (1 - cfg.mem_fraction_static) * total_bytes
            slots = int(max(budget, 0) // per_slot)
            if cfg.max_total_tokens:
                slots = min(slots, cfg.max_total_tokens)
        else:
            slots = cfg.max_total_tokens or CPU_DEFAULT_KV_TOKENS
        if slots < 2:
            raise RuntimeError(f"no memory left for the KV cache ({slots} slots); raise "
                               f"mem_fraction_static or free GPU memory")
        max_requests = cfg.max_running_requests + 8  # rows for chunked and preempted requests
        pool = KVPool(slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        logger.info("KV cache: %d slots (%.1f MiB)", slots, slots * per_slot / 2**20)
        return KVCache(pool, ReqToTokenPool(max_requests, self.context_len, self.device))

    # -- public API ----------------------------------------------------------------------------
    # Two ways in, one path inside: `generate` blocks on a batch, `submit` + `step` let requests
    # arrive while others are in flight (like vLLM's add_request / step). Both validate with
    # `_build`, queue with `_queue` and advance with `_step_scheduler`, which parks every
    # finished request in `self._finished` (rid -> Request, in finish order) until its caller
    # takes it: `generate` pops its own, `step` drains the rest. So a submitted request that
    # finishes while a `generate` call is looping is kept and returned by the next `step()`.
    def generate(self, prompt=None, sampling_params=None, input_ids=None, messages=None,
                 return_logprob=False, logprob_start_len=None, apply_chat_template=False,
                 stream=False):
        """stream=True (one request): an iterator of chunks as tokens arrive (stream_chunks)."""
        reqs, single = self._build(prompt, sampling_params, input_ids, messages, return_logprob,
                                   logprob_start_len, apply_chat_template, one=stream)
        self._queue(reqs)
        if stream:
            return self._stream(reqs[0])
        with self._lock:
            while any(r.rid not in self._finished for r in reqs):
                assert self.scheduler.has_work(), "a pending request left the scheduler unfinished"
                self._step_scheduler()
            outputs = [self._format_output(self._finished.pop(r.rid)) for r in reqs]
        return outputs[0] if single else outputs

    def _stream(self, req):
        from specpcg.streaming import TextStream

        text = TextStream(self.tokenizer, req)
        try:
            while True:
                with self._lock:
                    if req.rid not in self._finished:
                        self._step_scheduler()
                    done = self._finished.pop(req.rid, None)
                chunk = self.stream_chunk(text, done)
                if chunk is not None:
                    yield chunk
                if done is not None:
                    return
        finally:  # a consumer that stops early aborts its request: its KV is freed at once
            if not req.finished:
                self.abort(req.rid)
                with self._lock:
                    self._finished.pop(req.rid, None)

    def stream_chunk(self, text, done):
        """The next chunk of a stream (None when there is nothing new): the new text and ids,
        and, once done (the finished Request), the whole output as `generate` returns it."""
        part = text.next_chunk()
        if done is None and not part["delta"] and not part["delta_ids"]:
            return None
        out = self._format_output(done) if done is not None else {
            "text": None, "output_ids": None, "meta_info": {"id": text.req.rid,
                                                            "finish_reason": None}}
        return {**out, "delta": part["delta"], "delta_ids": part["delta_ids"]}

    def abort(self, rid: int) -> bool:
        """Ends request `rid` and frees its KV slots at once; its output (finish_reason
        "abort") comes back to whoever waits for it. False when it is not in flight."""
        with self._lock:
            req = self.scheduler.abort(rid)
            if req is not None:
                self._finished[req.rid] = req
        return req is not None

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             messages=None, return_logprob=False, logprob_start_len=None,
                             apply_chat_template=False, stream=False):
        """For asyncio callers: one request, run by a background thread that steps the
        engine (started on first use), so the event loop never waits on a forward. Returns
        the output, or with stream=True an async iterator of chunks."""
        from specpcg.engine_thread import EngineThread

        if self._thread is None:
            self._thread = EngineThread(self)
        chunks = await self._thread.submit(dict(
            prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
            messages=messages, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, apply_chat_template=apply_chat_template))
        if stream:
            return chunks
        async for chunk in chunks:
            last = chunk
        return {k: v for k, v in last.items() if k not in ("delta", "delta_ids")}

    def submit(self, prompt=None, sampling_params=None, input_ids=None, messages=None,
               return_logprob=False, logprob_start_len=None, apply_chat_template=False) -> int:
        """Validates and queues ONE request without running it; returns its id (the output's
        meta_info["id"]). Bad input raises ValueError as `generate` does and queues nothing."""
        reqs, single = self._build(prompt, sampling_params, input_ids, messages, return_logprob,
                                   logprob_start_len, apply_chat_template, one=True)
        self._queue(reqs)
        return reqs[0].rid

    def step(self) -> list:
        """Runs one scheduler step (when there is work) and returns the outputs, formatted as
        `generate` formats them, of every finished request not yet returned: submitted ones,
        including those that finished during a `generate` call."""
        with self._lock:
            if self.scheduler.has_work():
                self._step_scheduler()
            finished = list(self._finished.values())
            self._finished.clear()
            return [self._format_output(r) for r in finished]

    def has_unfinished(self) -> bool:
        """True while a request is in flight or a finished one awaits `step()`: loop
        `while engine.has_unfinished(): engine.step()` loses no output."""
        return self.scheduler.has_work() or bool(self._finished)

    @property
    def _finished(self) -> dict:
        """rid -> finished Request not yet returned to its caller, in finish order; made on
        first use so the buffer lives with the API that owns it."""
        return self.__dict__.setdefault("_finished_by_rid", {})

    def _build(self, prompt, sampling_params, input_ids, messages, return_logprob,
               logprob_start_len, apply_chat_template, one: bool = False) -> tuple:
        items, single = normalize_inputs(prompt, input_ids, messages)
        if one and not single:
            raise ValueError(f"submit takes one request, got a list of {len(items)} inputs; "
                             f"use generate for lists")
        reqs = build_requests(items, sampling_params, return_logprob, logprob_start_len,
                              self.tokenizer, apply_chat_template, self.model_config.vocab_size,
                              self.context_len, self.kv_cache.total_slots)
        return reqs, single

    def _queue(self, reqs: list) -> None:
        with self._lock:
            for req in reqs:
                req.generator = make_generator(req.params, self.device, self.config.random_seed,
                                               req.rid)
                self.scheduler.add(req)

    def _step_scheduler(self) -> None:
        for req in self.scheduler.step():
            self._finished[req.rid] = req

    def get_server_info(self) -> dict:
        return {
            "model_path": self.config.model_path, "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "attention_backend": self.attn_backend.name, "context_length": self.context_len,
            "enable_deterministic_inference": self.config.enable_deterministic_inference,
            "tp_size": self.config.tp_size, "pp_size": self.config.pp_size, "ranks":
            self.rank_reports, "kv_cache": self.kv_cache.info(), "load_time_s": self.load_time_s,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.graphs.info(), "forward_stats": self.router.forward_stats(),
            "internal_states": [{**self._stats, **(self.spec_decoder.stats()
                                                    if self.spec_decoder else {})}],
            "speculative": None if self.spec is None else {
                **vars(self.spec), "draft": self.draft.info(),
                "overlapped_steps": None if self.scheduler.spec_overlap is None
                else self.scheduler.spec_overlap.num_steps,
                "step_graphs": None if self.scheduler.spec_overlap is None
                else self.scheduler.spec_overlap.graphs.info(),
                "adaptive": None if self.scheduler.adaptive is None
                else self.scheduler.adaptive.info()},
        }

    def shutdown(self) -> None:
        """Drops the model, KV cache and graphs so their GPU memory can be reused."""
        import gc

        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
        tp, self.tp = self.tp, None
        if tp is not None:
            tp.stop()
        self.scheduler = self.router = self.graphs = self.runner = None
        self.attn_backend = self.kv_cache = self.model = None
        # They hold the router, KV caches and the head; the draft's context holds the target.
        self.spec_decoder = self.draft = self.draft_ctx = self._draft_target = None
        gc.unfreeze()  # frozen objects are never collected: the model's cycles among them
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _format_output(self, req) -> dict:
        self._stats["num_requests"] += 1
        self._stats["num_generated_tokens"] += len(req.output_ids)
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, req.params.skip_special_tokens)
            text = trim_stop_string(text, req)
        meta = {
            "id": req.rid, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids), "finish_reason": req.finish_reason,
            "e2e_latency": req.finished_at - req.created_at,
            "ttft": (req.first_token_at or req.finished_at) - req.created_at,
        }
        if self.spec is not None:
            meta.update(spec_meta(req, self.spec.num_draft_tokens))
        if req.return_logprob:
            meta["output_token_logprobs"] = list(req.output_logprobs)
            meta["input_token_logprobs"] = list(req.input_logprobs)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
