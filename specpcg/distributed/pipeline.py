"""Pipeline parallelism: the decoder layers cut into pp_size stages, one process each.

Rank 0 is stage 0 and more: it schedules, embeds, runs its layers, and gets the last stage's
residual stream back to apply the final norm and the LM head (which it holds), so sampling and
every draft stay on rank 0 as under tensor parallelism. Stage s receives (hidden, residual, the
aux-layer states so far) from stage s - 1, runs its layers and sends the same on; the states
travel as one [2 + num_aux, tokens, hidden] tensor whose size every rank knows from the batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from specpcg.models.llama import LlamaForCausalLM


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


def _aux_before(aux_layers, index: int) -> int:
    return sum(1 for i in aux_layers if i < index)


def _pack(hidden, residual, aux) -> torch.Tensor:
    return torch.stack([hidden, residual, *aux]).contiguous()  # [2 + A, T, H]


def _recv(num_aux: int, num_tokens: int, like: torch.Tensor, src: int) -> tuple:
    buf = like.new_empty(2 + num_aux, num_tokens, like.shape[-1])
    dist.recv(buf, src=src)
    return buf[0], buf[1], list(buf[2:])


class PipelineStage(LlamaForCausalLM):
    """Layers [start, end) of the target (renumbered from 0 for this stage's KV cache)."""

    def set_stage(self, stage: int, pp: int, start: int, end: int, total: int,
                  tp: int = 1, tp_rank: int = 0) -> None:
        """Stage `stage` of `pp`; with tensor parallelism each stage's tp ranks pass their
        states to the same tp rank of the next stage."""
        self.stage_info = (stage, pp, start, end, total, tp, tp_rank)
        self.stage, self.pp, self.start, self.end, self.total = stage, pp, start, end, total
        self.tp, self.tp_rank = tp, tp_rank

    def _rank_of(self, stage: int) -> int:
        return stage * self.tp + self.tp_rank

    def _layers(self, positions, hidden, residual, aux_layers, aux):
        for j, layer in enumerate(self.model.layers):
            if self.start + j in aux_layers:  # the residual stream entering global layer i
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual)
        if self.end == self.total and self.total in aux_layers:
            aux.append(hidden + residual)
        return hidden, residual

    def forward(self, input_ids, positions, aux_layers: tuple = ()):
        """Rank 0: the whole pipeline's forward (stage 0, the others, the final norm)."""
        hidden, aux = self.model.embed_tokens(input_ids), []
        hidden, residual = self._layers(positions, hidden, None, aux_layers, aux)
        dist.send(_pack(hidden, residual, aux), dst=self._rank_of(1))
        n = sum(1 for i in aux_layers if i <= self.total)
        hidden, residual, aux = _recv(n, hidden.shape[0], hidden, src=self._rank_of(self.pp - 1))
        hidden, _ = self.model.norm.forward_add(hidden, residual)
        return hidden, aux

    def run_stage(self, positions, num_tokens: int, aux_layers: tuple, like) -> None:
        """Ranks 1..: receive from the stage before, run, send on (the last: to rank 0)."""
        hidden, residual, aux = _recv(_aux_before(aux_layers, self.start), num_tokens, like,
                                      src=self._rank_of(self.stage - 1))
        hidden, residual = self._layers(positions, hidden, residual, aux_layers, aux)
        dist.send(_pack(hidden, residual, aux), dst=self._rank_of((self.stage + 1) % self.pp))


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
