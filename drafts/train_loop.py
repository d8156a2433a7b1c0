"""The optimisation loop shared by every draft trainer: AdamW, warmup + cosine over a wall-clock
budget, batches by tokens, fp32 weights with TF32 matmuls, held-out top-1 accuracy per step."""

from __future__ import annotations

import functools
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class LoopOptions:
    minutes: float = 4.0  # wall clock of the optimisation loop itself
    max_epochs: int = 40
    max_steps: Optional[int] = None  # None: max_epochs over the training batches
    lr: float = 5e-4
    warmup_frac: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    token_budget: int = 16384  # padded tokens per batch
    seed: int = 0
    show_progress: bool = True


@contextmanager
def autograd_ops(model):
    """Lets autograd run through `model`'s decoder layers, for the duration of the block.

    NOTE: (1) the fused Triton kernels (RMSNorm, rotary, SiLU-and-mul) have no backward: on
    CUDA their outputs would come back detached and training would silently skip every norm.
    `kernels.fused_ops` picks Triton for CUDA tensors unless triton is missing, so we say it is
    missing. (2) LlamaAttention rotates q and k in place on views of one `split`, which autograd
    refuses; its instances run `_attention_forward` instead, which rotates copies. Both would
    go with the two-line change to `LlamaAttention.forward` proposed with this trainer."""
    from kernels import fused_ops
    from specpcg.models.llama import LlamaAttention

    attns = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    saved = fused_ops._HAS_TRITON
    fused_ops._HAS_TRITON = False
    for attn in attns:
        attn.forward = functools.partial(_attention_forward, attn)
    try:
        yield
    finally:
        fused_ops._HAS_TRITON = saved
        for attn in attns:
            del attn.forward


def _attention_forward(attn, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`LlamaAttention.forward` with q and k copied out of the qkv split before the in-place
    rotary (tests/test_train.py checks the two agree)."""
    from specpcg.models.llama import attention

    num_tokens = x.shape[0]
    q, k, v = attn.qkv_proj(x).split(attn.split_sizes, dim=-1)
    q = q.reshape(num_tokens, attn.num_heads, attn.head_dim).clone()
    k = k.reshape(num_tokens, attn.num_kv_heads, attn.head_dim).clone()
    v = v.contiguous()
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    attn.rotary(positions, q, k)  # in place, on the copies
    out = attention(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, attn.layer_id)
    return attn.o_proj(out)


@contextmanager
def tf32_matmuls():
    """fp32 training with TF32 matmuls on CUDA. NOTE: not bf16 autocast: the heads add their
    fp32 residual stream to bf16 layer outputs under autocast, which the fused ops refuse."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def lr_factor(progress: float, warmup_frac: float) -> float:
    """Linear warmup, then cosine decay to zero, over progress in [0, 1]."""
    if progress < warmup_frac:
        return (progress + 1e-3) / (warmup_frac + 1e-3)
    rest = (progress - warmup_frac) / max(1.0 - warmup_frac, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min(rest, 1.0)))


def _forever_shuffled(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(n, generator=gen).tolist()


PROBE_AT = (0.25, 0.5, 0.75)  # shares of the run where `probe` is called
LOSS_READ_EVERY = 32  # steps between reads of the losses (each read waits for the device)


def fit(model, params: list, batches: list, loss_fn, opts: LoopOptions, probe=None) -> dict:
    """Minimises `loss_fn(batch)` over `batches` (shuffled each epoch) until max_steps, or the
    time budget: the schedule runs on progress = max(step share, time share), so a budget cut
    still ends with a decayed learning rate. probe(): a held-out measure taken as the run
    passes each share in PROBE_AT (whether more epochs still pay shows in the log)."""
    opt = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95),
                            weight_decay=opts.weight_decay)
    max_steps = opts.max_steps or opts.max_epochs * len(batches)
    budget_s = max(opts.minutes * 60.0, 1e-3)
    losses, pending, t0, probes, probe_at = [], [], time.perf_counter(), [], list(PROBE_AT)
    bar = tqdm(total=max_steps, desc="train", unit="step", disable=not opts.show_progress)
    for step, j in zip(range(max_steps), _forever_shuffled(len(batches), opts.seed)):
        progress = max(step / max_steps, (time.perf_counter() - t0) / budget_s)
        if progress >= 1.0:
            break
        if probe is not None and probe_at and progress >= probe_at[0]:
            probe_at.pop(0)
            probes.append({"step": step, "epoch": step / max(len(batches), 1),
                           "value": probe()})
        for group in opt.param_groups:
            group["lr"] = opts.lr * lr_factor(progress, opts.warmup_frac)
        # NOTE: backward inside the TF32 block too: its matmuls (and the checkpointed logits'
        # recompute) run after the forward returns, and ran as plain fp32 GEMMs, 45% of a step's
        # GPU time on the H100 (benchmarks/results/train_profile_h100.txt).
        with autograd_ops(model), tf32_matmuls():
            loss = loss_fn(batches[j])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        bar.update(1)
        if len(pending) == LOSS_READ_EVERY:
            _read_losses(pending, losses, bar)
    _read_losses(pending, losses, bar)
    bar.close()
    return {"steps": len(losses), "epochs": len(losses) / max(len(batches), 1),
            "train_s": time.perf_counter() - t0, "losses": losses, "probes": probes}


def _read_losses(pending: list, losses: list, bar) -> None:
    """Moves the steps' losses (device scalars) to `losses` in one read. NOTE: a read per step
    waited for the device every step, so the host built each batch with the GPU idle."""
    if pending:
        losses += torch.stack(pending).tolist()
        pending.clear()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")


def heldout_curve(record: dict) -> list:
    """fit's probes (held-out top-1 per draft step), popped from its record, for the log."""
    return [{"step": p["step"], "epoch": round(p["epoch"], 3), "top1": p["value"]}
            for p in record.pop("probes")]


@torch.no_grad()
def evaluate(model, batches: list, eval_fn) -> list:
    """Top-1 accuracy per draft step: eval_fn(batch) -> (correct [S], counted [S]) tensors."""
    correct = counted = 0
    with autograd_ops(model), tf32_matmuls():
        for batch in batches:
            c, n = eval_fn(batch)
            correct, counted = correct + c.double(), counted + n.double()
    if not batches:
        return []
    return (correct / counted.clamp(min=1)).tolist()


def loss_curve(losses: list, points: int = 50) -> list:
    """Mean loss over `points` equal spans of the run (the log keeps the shape, not every step)."""
    if not losses:
        return []
    span = max(len(losses) // points, 1)
    return [sum(losses[i:i + span]) / len(losses[i:i + span]) for i in range(0, len(losses), span)]
