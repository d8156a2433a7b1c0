"""Tensor-parallel ranks: rank 0 (the engine's process) sends every forward's batch; ranks
1.. run the same forward on their shards in lockstep, so the collectives inside it meet.

Rank 0 alone schedules, samples and decides acceptance (so no rank can disagree); the others
only mirror its forwards, each the way rank 0 runs it (eager, or a piecewise graph that every
rank captured in lockstep). Each forward's message holds the batch and the req_to_token rows it
reads (KV data never moves between slots, so the rows are all a rank needs to mirror the cache).
A rank that dies makes the next step fail on rank 0 with its rank and exit code.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from dataclasses import replace

import torch
import torch.distributed as dist

from specpcg.distributed.group import (broadcast_message, gather_to_rank0, init_group,
                                       init_tp_groups)

logger = logging.getLogger("specpcg")


class RankExitedError(RuntimeError):
    """A rank is gone: the whole engine stops (the scheduler does not absorb it)."""

    fatal = True


def world_size(cfg) -> int:
    return cfg.tp_size * cfg.pp_size


def ranks_per_node(cfg) -> int:
    """Node k runs ranks k * n .. k * n + n - 1 (rank 0, the engine, on node 0)."""
    return world_size(cfg) // cfg.nnodes


def check_parallel(cfg, model_cfg) -> None:
    """Refuses a layout the model cannot take, before any other process starts."""
    from specpcg.distributed.pipeline import stage_bounds
    from specpcg.distributed.shard import check_tp

    check_tp(model_cfg, cfg.tp_size)
    stage_bounds(model_cfg.num_layers, cfg.pp_size)


def shard_of(full, full_cfg, cfg, rank: int):
    """Rank `rank`'s part of the whole model `full`: (model, its config). Rank r is tensor
    rank r % tp of pipeline stage stage_of(r): rank 0's group runs the last stage."""
    from specpcg.distributed.pipeline import make_stage_model, stage_of
    from specpcg.distributed.shard import make_tp_model

    tp, stage = cfg.tp_size, stage_of(rank, cfg.tp_size, cfg.pp_size)
    model, local = full, full_cfg
    if cfg.pp_size > 1:
        model, local = make_stage_model(full, full_cfg, stage, cfg.pp_size, tp, rank % tp)
    if tp > 1:
        model, local = make_tp_model(model, local, rank % tp, tp)
    return model, local


def load_shard(cfg, rank: int, device, dtype):
    """This rank's part of the target: (model, local config, full config, tokenizer)."""
    from specpcg.models.loading import load_target

    full, full_cfg, tokenizer = load_target(cfg, device, dtype)
    check_parallel(cfg, full_cfg)
    model, local = shard_of(full, full_cfg, cfg, rank)
    return model, local, full_cfg, tokenizer


def worker_main(cfg, rank: int, init_addr: str, errors=None) -> None:
    """Rank `rank`'s process: runs its part of every forward until rank 0 says stop. An
    exception goes to `errors` (rank 0 reads it to name the reason) before the process exits."""
    try:
        _serve(cfg, rank, init_addr)
    except BaseException as exc:
        if errors is not None:
            errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _serve(cfg, rank: int, init_addr: str) -> None:
    from specpcg.engine import freeze_startup_objects
    from specpcg.graphs.setup import build_graphs

    device = cfg.resolve_device()
    if device.type == "cuda":
        device = torch.device("cuda", rank % ranks_per_node(cfg))  # this node's GPUs
        torch.cuda.set_device(device)
    init_group(init_addr, rank, world_size(cfg), device, cfg.dist_timeout_s)
    init_tp_groups(cfg.tp_size, cfg.pp_size)
    torch.set_num_threads(1)
    model, local, _, _ = load_shard(replace(cfg, skip_tokenizer_init=True), rank, device,
                                    cfg.resolve_dtype(device))
    runner = mirror_runner(cfg, model, local, broadcast_message(), device)
    like = next(model.parameters())
    graphs = draft = None
    freeze_startup_objects()  # a rank's collection pause would stall every rank's collectives
    while True:
        msg = broadcast_message()
        if msg is None:
            break
        if msg[0] == "graphs":  # rank 0 captures now: capture the same, collective by collective
            _, context_len, needs = msg
            graphs = build_graphs(replace(cfg, show_progress=False), runner, context_len,
                                  **needs)
            continue
        if msg[0] == "report":
            gather_to_rank0(rank_report(cfg, rank, graphs, device))
            continue
        if msg[0] == "draft_setup":
            if rank < cfg.tp_size:  # rank 0's stage (the last) drafts
                draft = draft_runner(cfg, msg[1], rank, device)
            continue
        kind, batch, rows, table, route = msg
        into = draft if kind == "draft" else runner
        if into is None:
            continue  # a draft forward, and this rank holds no draft (another stage)
        into.kv_cache.req_pool.req_to_token[rows, :table.shape[1]] = table.to(device)
        if kind == "draft":
            draft.forward(batch.to(device))
        else:
            mirror(runner, graphs, batch.to(device), route, rank >= cfg.tp_size, like)
    dist.destroy_process_group()


def rank_report(cfg, rank: int, graphs, device) -> dict:
    """What one rank's start-up cost: its graphs' capture time and memory, and the GPU memory
    it holds (weights, KV cache and graphs) and held at most."""
    from specpcg.distributed.pipeline import stage_of

    out = {"rank": rank, "tp_rank": rank % cfg.tp_size,
           "stage": stage_of(rank, cfg.tp_size, cfg.pp_size)}
    for name, info in (graphs.info() if graphs is not None else {}).items():
        out[name] = {k: info[k] for k in ("enabled", "capture_time_s", "capture_memory_mb")
                     if k in info}
    if device.type == "cuda":
        out["memory_allocated_mb"] = round(torch.cuda.memory_allocated(device) / 2**20, 1)
        out["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def mirror_runner(cfg, model, mc, setup: dict, device):
    """A ModelRunner of `model` (local config `mc`) over a KV cache shaped like rank 0's
    (`setup`: its total_slots, rows and context_len), to mirror rank 0's forwards."""
    from specpcg.attention import create_attention_backend
    from specpcg.kv_cache import KVCache, KVPool, ReqToTokenPool
    from specpcg.model_runner import ModelRunner

    pool = KVPool(setup["total_slots"], mc.num_layers, mc.num_kv_heads, mc.head_dim,
                  cfg.resolve_dtype(device), device)
    kv = KVCache(pool, ReqToTokenPool(setup["rows"], setup["context_len"], device))
    attn = create_attention_backend(cfg.attention_backend, device, kv, mc.num_heads,
                                    mc.num_kv_heads, mc.head_dim, mc.head_dim ** -0.5,
                                    verify_kernel=cfg.resolve_verify_kernel())
    return ModelRunner(model, kv, attn, device)


def draft_runner(cfg, setup: dict, rank: int, device):
    """This rank's shard of a draft model sharded like the target (`setup`: TPDriver.setup_draft's
    message) over a cache of rank 0's draft slots: the runner of rank 0's draft forwards."""
    from specpcg.distributed.shard import make_tp_model
    from specpcg.models.loading import draft_load_config, load_target

    full, full_cfg, _ = load_target(draft_load_config(cfg, setup["model_path"]), device,
                                    cfg.resolve_dtype(device))
    model, mc = make_tp_model(full, full_cfg, rank % cfg.tp_size, cfg.tp_size)
    return mirror_runner(cfg, model, mc, setup, device)


def mirror(runner, graphs, batch, route: str, other_stage: bool, like) -> None:
    """Runs rank 0's forward of `batch` the way rank 0 runs it (`route`: the router's choice),
    so the collectives of a graph's breaks and of an eager forward meet their twins.
    other_stage: this rank runs a pipeline stage other than rank 0's (the last), which stops
    at its body: its outputs go on to the next stage."""
    if route == "piecewise":
        if graphs is None or graphs.piecewise is None:
            raise RuntimeError("rank 0 replayed a piecewise graph that this rank did not capture")
        if other_stage:
            graphs.piecewise.replay_body(batch)
        else:
            graphs.piecewise.forward(batch)
    elif route != "eager":
        raise RuntimeError(f"rank 0 ran {route!r}, which the other ranks cannot mirror")
    elif other_stage:
        _run_stage(runner, batch, like)
    else:
        runner.forward(batch)


@torch.inference_mode()
def _run_stage(runner, batch, like) -> None:
    from specpcg.forward_context import ForwardContext, forward_context

    runner.attn_backend.init_forward_metadata(batch)
    ctx = ForwardContext(batch=batch, attn_backend=runner.attn_backend,
                         num_tokens=batch.num_tokens)
    with forward_context(ctx):
        runner.model.run_stage(batch.input_ids, batch.positions, batch.aux_hidden_layers, like)


class TPDriver:
    """Rank 0's side: starts the other ranks, sends each forward, stops them."""

    def __init__(self, cfg, init_addr: str):
        if dist.is_initialized():
            raise RuntimeError("another tensor-parallel engine runs in this process: shut it "
                               "down first (one process group per process)")
        self.procs, self.errors = start_ranks(cfg, range(1, ranks_per_node(cfg)), init_addr)
        init_group(init_addr, 0, world_size(cfg), cfg.resolve_device(), cfg.dist_timeout_s)
        init_tp_groups(cfg.tp_size, cfg.pp_size)
        self.kv_cache = None

    def setup(self, kv_cache) -> None:
        self.kv_cache = kv_cache
        table = kv_cache.req_pool.req_to_token
        self._send({"total_slots": kv_cache.total_slots, "rows": table.shape[0],
                    "context_len": table.shape[1]})

    def before_forward(self, batch, route: str = "eager") -> None:
        """Sends `batch`, its requests' req_to_token rows and how rank 0 runs it (`route`: a
        graph runner's name or "eager") to every other rank."""
        self._send(forward_message("forward", self.kv_cache, batch, route))

    def setup_draft(self, kv_cache, model_path: str) -> None:
        """A draft sharded like the target (`model_path`, its KV cache on rank 0 `kv_cache`):
        the ranks of rank 0's stage load their shards and a cache of the same slots."""
        table = kv_cache.req_pool.req_to_token
        self._send(("draft_setup", {"model_path": model_path, "total_slots": kv_cache.total_slots,
                                    "rows": table.shape[0], "context_len": table.shape[1]}))

    def draft_announcer(self, kv_cache):
        """The sharded draft runner's before_forward: its forwards go to every rank like the
        target's, with the draft cache's rows (its forwards are always eager: they hold
        collectives, which no full graph may)."""
        def before_forward(batch, route: str = "eager") -> None:
            if route != "eager":
                raise RuntimeError(f"a sharded draft ran {route!r}: its forwards run eagerly")
            self._send(forward_message("draft", kv_cache, batch, route))
        return before_forward

    def build_graphs(self, context_len: int, needs: dict) -> None:
        """Before rank 0 captures: every rank builds the same graphs (build_graphs' arguments)
        and captures them in the same order, so each capture's collectives meet."""
        self._send(("graphs", context_len, needs))

    def reports(self, cfg, graphs, device) -> list:
        """Every rank's rank_report in rank order (rank 0's of `graphs` on `device`), gathered
        once the graphs are captured: start-up only, since no other message may interleave
        with a step's."""
        self._send(("report",))
        return gather_to_rank0(rank_report(cfg, 0, graphs, device))

    def _send(self, msg) -> None:
        self.check_alive()
        try:
            broadcast_message(msg)
        except RuntimeError as exc:
            self.check_alive()
            raise RankExitedError(f"parallel step failed: {exc}") from exc

    def check_alive(self) -> None:
        """This node's ranks; a rank of another node that dies fails the next collective."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RankExitedError(f"parallel rank {rank} exited (exit code "
                                      f"{p.exitcode}){exit_reason(self.errors, rank)}; the "
                                      f"engine cannot go on: shut it down")

    def stop(self) -> None:
        if all(p.is_alive() for p in self.procs):
            try:
                broadcast_message(None)
            except RuntimeError:
                pass  # a rank died in between: terminate below
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self.errors.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def forward_message(kind: str, kv_cache, batch, route: str) -> tuple:
    """(kind, the batch on the host, its requests' rows, those rows of `kv_cache`'s
    req_to_token, route): all another rank needs to mirror the forward."""
    bs, sent = batch.batch_size, batch.to("cpu")
    width = max(batch.seq_lens_cpu[:bs], default=0)
    table = kv_cache.req_pool.req_to_token[batch.req_pool_indices[:bs], :width].cpu()
    return kind, sent, sent.req_pool_indices[:bs], table, route


def rank_errors(errors, wait_s: float = 0.5) -> dict:
    """{rank: what it raised} from the ranks that said so before exiting (a killed rank says
    nothing); waits up to wait_s for the first, since a dying rank may still be sending it."""
    import queue

    said = {}
    try:
        while True:
            rank, text = errors.get(timeout=wait_s) if not said else errors.get_nowait()
            said[rank] = text
    except queue.Empty:
        pass
    return said


def exit_reason(errors, rank: int) -> str:
    """What `rank` raised, worded to end an error message, or nothing when it said nothing."""
    said = rank_errors(errors).get(rank)
    return f" after {said}" if said else ""


def start_ranks(cfg, ranks, init_addr: str) -> tuple:
    """(the ranks' started processes, the queue where a failing rank says what it raised)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(cfg, rank, init_addr, errors),
                         name=f"specpcg-tp{rank}", daemon=True) for rank in ranks]
    for p in procs:
        p.start()
    return procs, errors


def run_node(cfg, poll_s: float = 0.5) -> None:
    """Node node_rank >= 1 of a multi-machine engine: runs this node's ranks until node 0's
    engine shuts down. A rank that fails stops the others here and raises naming it."""
    import time

    if cfg.node_rank < 1:
        raise ValueError(f"node_rank={cfg.node_rank}: node 0 runs the engine itself (Engine)")
    first = cfg.node_rank * ranks_per_node(cfg)
    procs, errors = start_ranks(cfg, range(first, first + ranks_per_node(cfg)),
                                cfg.dist_init_addr)
    logger.warning("node %d runs ranks %d..%d of %d", cfg.node_rank, first,
                   first + len(procs) - 1, world_size(cfg))
    try:
        while True:
            for rank, p in enumerate(procs, start=first):
                if p.exitcode:  # None while running, 0 when done
                    raise RankExitedError(f"parallel rank {rank} exited (exit code "
                                          f"{p.exitcode}) on node {cfg.node_rank}"
                                          f"{exit_reason(errors, rank)}")
            if not any(p.is_alive() for p in procs):
                return
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
