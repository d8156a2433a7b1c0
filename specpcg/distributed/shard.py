"""A Llama-family model cut into tensor-parallel shards.

- q/k/v and gate/up stay one GEMM each per shard (column parallel: each rank keeps its heads'
  rows of q, k and v, its share of the gate and of the up rows);
- o_proj and down_proj are row parallel (each rank's slice of the input columns, then one
  all-reduce);
- KV heads split across ranks, or are replicated where there are fewer KV heads than ranks;
- the embedding and the LM head are vocabulary parallel (ranks hold row ranges; lookups sum
  across ranks, logits are gathered once for sampling).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from specpcg.distributed.group import all_gather_last, all_reduce_


def check_tp(cfg, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if cfg.num_heads % tp:
        raise ValueError(f"tp_size={tp} does not divide the model's {cfg.num_heads} attention "
                         f"heads")
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"tp_size={tp} and the model's {kv} KV heads: one must divide the "
                         f"other (KV heads are split, or replicated when fewer than ranks)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp_size={tp} does not divide intermediate_size "
                         f"{cfg.intermediate_size}")


def local_config(cfg, tp: int):
    return replace(cfg, num_heads=cfg.num_heads // tp,
                   num_kv_heads=max(cfg.num_kv_heads // tp, 1),
                   intermediate_size=cfg.intermediate_size // tp)


def vocab_range(vocab: int, rank: int, tp: int) -> tuple:
    per = -(-vocab // tp)  # rows per rank; the last rank's past `vocab` are padding
    return rank * per, per


class RowParallelLinear(nn.Linear):
    def forward(self, x):
        out = all_reduce_(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows, hidden]
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * inside[:, None].to(out.dtype)
        return all_reduce_(out)


def _rows(w: torch.Tensor, start: int, num: int) -> torch.Tensor:
    """Rows start..start + num of w, zero-padded past its end."""
    part = w[start:start + num]
    if part.shape[0] < num:
        part = torch.cat([part, part.new_zeros(num - part.shape[0], *w.shape[1:])])
    return part


def shard_state(state: dict, cfg, rank: int, tp: int) -> dict:
    """Our (fused) parameter names -> this rank's slices."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    lq, lkv = hq // tp, max(hkv // tp, 1)
    # This rank's first KV head: its own share, or (fewer KV heads than ranks) the one its
    # query heads read, replicated on tp // hkv ranks.
    kv_first = rank * lkv if hkv >= tp else rank // (tp // hkv)
    inter = cfg.intermediate_size // tp
    out = {}
    for name, w in state.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q, k, v = w.split([hq * d, hkv * d, hkv * d])
            w = torch.cat([q[rank * lq * d:(rank + 1) * lq * d],
                           k[kv_first * d:(kv_first + lkv) * d],
                           v[kv_first * d:(kv_first + lkv) * d]])
        elif name.endswith("o_proj.weight"):
            w = w[:, rank * lq * d:(rank + 1) * lq * d]
        elif name.endswith("gate_up_proj.weight"):
            gate, up = w.chunk(2)
            w = torch.cat([gate[rank * inter:(rank + 1) * inter],
                           up[rank * inter:(rank + 1) * inter]])
        elif name.endswith("down_proj.weight"):
            w = w[:, rank * inter:(rank + 1) * inter]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, per = vocab_range(cfg.vocab_size, rank, tp)
            w = _rows(w, start, per)
        out[name] = w.contiguous()
    return out


def gathered_logits(vocab: int):
    """The LM head's matmul under TP: local logits, gathered, cut to the real vocabulary."""
    def head_linear(hidden, weight):
        return all_gather_last(F.linear(hidden, weight))[..., :vocab]
    return head_linear


def make_tp_model(full_model, cfg, rank: int, tp: int):
    """This rank's shard of `full_model` (a LlamaForCausalLM), as a new model with the local
    config; returns (model, local config)."""
    check_tp(cfg, tp)
    local = local_config(cfg, tp)
    state = shard_state(full_model.state_dict(), cfg, rank, tp)
    from specpcg.models.build import empty_model

    dtype = next(full_model.parameters()).dtype
    device = next(full_model.parameters()).device
    model = empty_model(local, device, dtype, type(full_model))  # a pipeline stage stays one
    if hasattr(full_model, "stage_info"):
        model.set_stage(*full_model.stage_info)
    start, _ = vocab_range(cfg.vocab_size, rank, tp)
    model.model.embed_tokens = VocabParallelEmbedding(state.pop("model.embed_tokens.weight"),
                                                      start)
    if "lm_head.weight" in state:
        model.lm_head = nn.Linear(cfg.hidden_size, state["lm_head.weight"].shape[0],
                                  bias=False, device=device, dtype=dtype)
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old_lin = getattr(parent, name)
            old_lin.__class__ = RowParallelLinear
    model.load_state_dict(state, strict=False)
    missing = [k for k in model.state_dict() if k not in state and "rotary" not in k
               and k != "model.embed_tokens.weight"]
    assert not missing, f"shards miss {missing[:4]}"
    model.head_linear = gathered_logits(cfg.vocab_size)
    return model.eval().requires_grad_(False), local


class FullVocabView(nn.Module):
    """What a draft head borrows of the target (its embedding and LM head), whole, on rank 0:
    a head runs on rank 0 alone, so it must not enter the vocabulary-parallel collectives."""

    def __init__(self, full_model):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = full_model.model.embed_tokens
        self._head = [full_model.head_weight]  # outside the parameter tree

    @property
    def head_weight(self) -> torch.Tensor:
        return self._head[0]
