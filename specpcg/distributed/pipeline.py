"""Pipeline parallelism: the decoder layers cut into pp_size stages, one process each.

Rank 0 runs the last stage, and more: it schedules, and applies the final norm and the LM head
to the states its own layers end with, so the final hidden states arise where sampling and
every draft run (a draft reads them with no transfer, and its proposals are already with the
scheduler, which sends the next verify's batch to every rank). The first stage runs on ranks
tp .. 2 tp - 1 and embeds; stage s receives (hidden, residual, the aux-layer states so far)
from stage s - 1, runs its layers and sends the same on; the states travel as one
[tokens, 2 + num_aux, hidden] tensor whose size every rank knows from the batch. The states flow
one way, first stage to last: no stage hands anything back.

Micro-batches: a forward of several requests is cut into up to pp_size groups of whole requests
(micro_batches), and each stage sends a group on as soon as it is done, so stage s works on
group g + 1 while stage s + 1 works on group g. Every rank cuts the batch the same way.

Piecewise graphs: every stage captures its part of the forward for each bucket, in lockstep
(worker.py), with the receives and sends as eager breaks; a graph is captured for one request,
so a replayed prefill goes as one micro-batch. Decode steps and verifies keep their
micro-batches: each stage replays a graph of its own layers per micro-batch (stage_graphs.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from specpcg.core import ForwardBatch
from specpcg.forward_context import get_forward_context
from specpcg.graphs.breakable import eager_break, is_capturing

from specpcg.models.llama import LlamaForCausalLM, run_layers


def stage_bounds(num_layers: int, pp: int) -> list:
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp_size={pp} must be between 1 and the model's {num_layers} layers")
    per, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for s in range(pp):
        end = start + per + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def stage_of(rank: int, tp: int, pp: int) -> int:
    """The stage rank `rank` runs: rank 0's group (ranks 0 .. tp - 1) the last, then ranks tp ..
    2 tp - 1 the first, and on in order."""
    return (rank // tp - 1) % pp


def rank_of(stage: int, tp: int, pp: int, tp_rank: int = 0) -> int:
    """Tensor rank `tp_rank` of stage `stage` (stage_of's inverse)."""
    return ((stage + 1) % pp) * tp + tp_rank


def aux_before(aux_layers, index: int) -> int:
    """How many aux-layer states a stage starting at layer `index` receives."""
    return sum(1 for i in aux_layers if i < index)


def _pack(hidden, residual, aux) -> torch.Tensor:
    # Tokens first: a piecewise graph stages a break's tensors by their first dimension.
    return torch.stack([hidden, residual, *aux], dim=1)  # [T, 2 + A, H]


def _recv(num_aux: int, num_tokens: int, like: torch.Tensor, src: int, group=None) -> tuple:
    buf = _recv_into(like.new_empty(num_tokens, 2 + num_aux, like.shape[-1]), src, group)
    # Contiguous copies: the layers' fused kernels read rows of H in a row.
    return buf[:, 0].contiguous(), buf[:, 1].contiguous(), [buf[:, 2 + j].contiguous()
                                                            for j in range(num_aux)]


@eager_break
def _recv_into(buf: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receives a stage's states into `buf`. A graph break: a piecewise graph runs it between
    segments (so do the sends, _send_now)."""
    dist.recv(buf, src=src, group=group)
    return buf


@eager_break
def _send_now(packed: torch.Tensor, dst: int, group=None) -> None:
    dist.isend(packed, dst=dst, group=group).wait()


def _send(packed: torch.Tensor, dst: int, sends: list, group=None) -> None:
    """Sends `packed` on. Eagerly the send stays in flight (`sends`, waited for at the end of
    the forward) so the next micro-batch overlaps it; in a capture it is a break of its own
    (one micro-batch: a graph is captured for one request)."""
    if is_capturing():
        _send_now(packed, dst, group)
    else:
        sends.append(_isend(packed, dst, group))


def micro_batches(batch: ForwardBatch, groups: int) -> list:
    """(first request, end request, first token, end token) of up to `groups` groups of whole
    requests with about as many tokens each; one group where the batch cannot be cut (a draft
    tree's mask, strided rows, a single request)."""
    bs = batch.batch_size
    if groups < 2 or bs < 2 or batch.tree_mask is not None or batch.req_row_stride:
        return [(0, bs, 0, batch.num_tokens)]
    lens, total = batch.extend_seq_lens_cpu, sum(batch.extend_seq_lens_cpu)
    out, start, tok, acc = [], 0, 0, 0
    for i, n in enumerate(lens):
        acc += n
        if acc * groups >= total * (len(out) + 1) and len(out) < groups - 1 and i + 1 < bs:
            out.append((start, i + 1, tok, acc))
            start, tok = i + 1, acc
    return out + [(start, bs, tok, total)]


def sub_batch(batch: ForwardBatch, r0: int, r1: int, t0: int, t1: int) -> ForwardBatch:
    """Requests r0..r1 (tokens t0..t1) of a packed batch, as a batch of their own."""
    return replace(batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
                   out_cache_loc=batch.out_cache_loc[t0:t1],
                   req_pool_indices=batch.req_pool_indices[r0:r1],
                   seq_lens=batch.seq_lens[r0:r1], extend_seq_lens=batch.extend_seq_lens[r0:r1],
                   seq_lens_cpu=batch.seq_lens_cpu[r0:r1],
                   extend_seq_lens_cpu=batch.extend_seq_lens_cpu[r0:r1],
                   input_hidden=None if batch.input_hidden is None
                   else batch.input_hidden[t0:t1])


def _isend(packed: torch.Tensor, dst: int, group=None) -> tuple:
    return packed, dist.isend(packed, dst=dst, group=group)  # kept alive until it is sent


def _wait(sends: list) -> None:
    for _, work in sends:
        work.wait()


@contextmanager
def _attending(batch: ForwardBatch, r0: int, r1: int, t0: int, t1: int):
    """Attention of the forward in flight sees requests r0..r1 of `batch` for the block, their
    metadata planned; a group of the whole batch keeps the plan the runner made."""
    if r0 == 0 and r1 == batch.batch_size:
        yield
        return
    ctx = get_forward_context()
    part = sub_batch(batch, r0, r1, t0, t1)
    whole, num_tokens = ctx.batch, ctx.num_tokens
    ctx.batch, ctx.num_tokens = part, part.num_tokens
    ctx.attn_backend.init_forward_metadata(part)
    try:
        yield
    finally:
        ctx.batch, ctx.num_tokens = whole, num_tokens


class PipelineStage(LlamaForCausalLM):
    """Layers [start, end) of the target (renumbered from 0 for this stage's KV cache)."""

    body_graphs = None  # StageGraphs once captured: decode micro-batches replay them

    def set_stage(self, stage: int, pp: int, start: int, end: int, total: int,
                  tp: int = 1, tp_rank: int = 0) -> None:
        """Stage `stage` of `pp`; with tensor parallelism each stage's tp ranks pass their
        states to the same tp rank of the next stage."""
        self.stage_info = (stage, pp, start, end, total, tp, tp_rank)
        self.stage, self.pp, self.start, self.end, self.total = stage, pp, start, end, total
        self.tp, self.tp_rank = tp, tp_rank

    def _rank_of(self, stage: int) -> int:
        return rank_of(stage, self.tp, self.pp, self.tp_rank)

    def _run_group(self, batch, group: tuple, positions, hidden, residual, aux_layers, aux):
        """This stage's layers on micro-batch `group` of `batch`: a replay of its decode graph
        where one serves it (stage_graphs.py), else eagerly. (hidden, residual, aux)."""
        r0, r1, t0, t1 = group
        graphs = self.body_graphs
        if graphs is not None and graphs.serves(batch, t1 - t0, aux_layers):
            whole = r0 == 0 and r1 == batch.batch_size
            part = batch if whole else sub_batch(batch, r0, r1, t0, t1)
            return graphs.run(part, hidden, residual, aux)
        with _attending(batch, r0, r1, t0, t1):
            hidden, residual = self._layers(positions[t0:t1], hidden, residual, aux_layers, aux)
        return hidden, residual, aux

    def _layers(self, positions, hidden, residual, aux_layers, aux):
        at = {i - self.start for i in aux_layers}  # global layer ids, counted in this stage
        hidden, residual = run_layers(self.model.layers, positions, hidden, residual, at, aux)
        if self.end == self.total and self.total in aux_layers:
            aux.append(hidden + residual)
        return hidden, residual

    def forward(self, input_ids, positions, aux_layers: tuple = ()):
        """The last stage (rank 0's group): per micro-batch, the states from the stage before
        through its layers and the final norm; (hidden, aux) of the whole batch for the LM head.
        Another stage runs its own part (run_stage): that is what its piecewise graphs capture;
        its outputs went on to the next stage, so it returns none."""
        like = self.model.embed_tokens.weight
        if self.stage < self.pp - 1:
            self.run_stage(input_ids, positions, aux_layers, like)
            return positions.new_empty(0), []
        batch, num_in = get_forward_context().batch, aux_before(aux_layers, self.start)
        num_out = sum(1 for i in aux_layers if i <= self.total)
        hidden_out = like.new_empty(batch.num_tokens, like.shape[-1])  # [T, H]
        aux_out = [torch.empty_like(hidden_out) for _ in range(num_out)]  # each [T, H]
        for group in micro_batches(batch, self.pp):
            t0, t1 = group[2:]
            hidden, residual, aux = _recv(num_in, t1 - t0, like, src=self._rank_of(self.stage - 1))
            hidden, residual, aux = self._run_group(batch, group, positions, hidden, residual,
                                                    aux_layers, aux)
            # Written out before the next micro-batch: a replay's outputs are its graph's.
            hidden_out[t0:t1] = self.model.norm.forward_add(hidden, residual)[0]
            for out, a in zip(aux_out, aux):
                out[t0:t1] = a
        return hidden_out, aux_out

    def run_stage(self, input_ids, positions, aux_layers: tuple, like) -> None:
        """Every stage but the last: per micro-batch, embed (the first) or receive from the
        stage before, run, send on."""
        batch, sends = get_forward_context().batch, []
        first = self.stage == 0
        embedded = self.model.embed_tokens(input_ids) if first else None
        for group in micro_batches(batch, self.pp):
            t0, t1 = group[2:]
            if first:
                hidden, residual, aux = embedded[t0:t1], None, []
            else:
                hidden, residual, aux = _recv(aux_before(aux_layers, self.start), t1 - t0,
                                              like, src=self._rank_of(self.stage - 1))
            hidden, residual, aux = self._run_group(batch, group, positions, hidden, residual,
                                                    aux_layers, aux)
            _send(_pack(hidden, residual, aux), self._rank_of(self.stage + 1), sends)
        _wait(sends)


def make_stage_model(full_model, cfg, stage: int, pp: int, tp: int = 1, tp_rank: int = 0):
    """Stage `stage` of `full_model`: (PipelineStage, its config with its layer count)."""
    bounds = stage_bounds(cfg.num_layers, pp)
    start, end = bounds[stage]
    local = replace(cfg, num_layers=end - start)
    from specpcg.models.build import empty_model

    p = next(full_model.parameters())
    model = empty_model(local, p.device, p.dtype, PipelineStage)
    state = {}
    for name, w in full_model.state_dict().items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if not start <= i < end:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{i - start}.", 1)
        state[name] = w
    model.load_state_dict(state, strict=False)
    model.set_stage(stage, pp, start, end, cfg.num_layers, tp, tp_rank)
    return model.eval().requires_grad_(False), local
