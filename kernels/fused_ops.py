"""Fused decoder-layer ops: RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

Each op has a torch twin (`*_torch`, the reference: the same arithmetic as
`specpcg.models.layers`) and a Triton kernel (`norm.py`, `rotary.py`, `activation.py`), one kernel
launch per op where the torch version launches several. The dispatchers pick:

- `use_triton=None` (default): Triton for CUDA tensors (when triton is installed), the twin
  otherwise;
- `use_triton=True`: Triton; a CPU tensor needs TRITON_INTERPRET=1 set before the kernels are
  first imported (tests);
- `use_triton=False`: the twin (benchmarks, debugging).

Nothing here reads tensor values on the host or sizes an allocation by them, so every op can be
captured in a CUDA graph (Triton compiles on the first call: warm up before capture). Triton is
imported lazily, on the first Triton call: `import kernels.fused_ops` works without it, and the
interpreter flag is read when the kernels are first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.nn.functional as F

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _pick_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return x.is_cuda and _HAS_TRITON
    if use_triton and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"use_triton=True on a {x.device.type!r} tensor needs the Triton "
                         "interpreter: set TRITON_INTERPRET=1 before kernels are first imported")
    return bool(use_triton)


def _check_out(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device,
               name: str) -> torch.Tensor:
    """Returns `out` once checked, or a new contiguous tensor when none was given."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [T, H] with unit stride along H (a view when the layout allows it)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


# ---- RMSNorm ---------------------------------------------------------------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE: normalise in fp32, round to x.dtype, then scale: layers.RMSNorm's (and HF's) order.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_torch(new_residual, weight, eps), new_residual


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")


def _check_triton_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    max_hidden = _kernels("norm").MAX_HIDDEN
    if x.shape[-1] > max_hidden:
        raise ValueError(f"the Triton RMSNorm takes rows of at most {max_hidden}, got "
                         f"{x.shape[-1]}; pass use_triton=False for the torch twin")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """x: [..., H] (e.g. [T, H]), weight: [H] -> y like x, dtype promote(x, weight)."""
    _check_norm(x, weight)
    y_dtype = torch.promote_types(x.dtype, weight.dtype)
    if not _pick_triton(x, use_triton):
        y = rms_norm_torch(x, weight, eps)
        return y if out is None else _check_out(out, x.shape, y_dtype, x.device, "out").copy_(y)
    _check_triton_norm(x, weight)
    out = _check_out(out, x.shape, y_dtype, x.device, "out")
    _kernels("norm").rms_norm_triton(_rows(x), weight, eps, out.view(-1, x.shape[-1]))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None,
                       use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] of one dtype; weight: [H] -> (rmsnorm(x + residual), x + residual).

    `residual_out` (and `out`) may be `residual` or `x` itself for an in-place update."""
    _check_norm(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    y_dtype = torch.promote_types(x.dtype, weight.dtype)
    if not _pick_triton(x, use_triton):
        y, new_residual = fused_add_rms_norm_torch(x, residual, weight, eps)
        if residual_out is not None:
            new_residual = _check_out(residual_out, x.shape, x.dtype, x.device,
                                      "residual_out").copy_(new_residual)
        if out is not None:
            y = _check_out(out, x.shape, y_dtype, x.device, "out").copy_(y)
        return y, new_residual
    _check_triton_norm(x, weight)
    out = _check_out(out, x.shape, y_dtype, x.device, "out")
    residual_out = _check_out(residual_out, x.shape, x.dtype, x.device, "residual_out")
    hidden_size = x.shape[-1]
    _kernels("norm").fused_add_rms_norm_triton(
        _rows(x), _rows(residual), weight, eps, out.view(-1, hidden_size),
        residual_out.view(-1, hidden_size))
    return out, residual_out


# ---- rotary embedding ------------------------------------------------------------------------

def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_embedding_torch_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            cos_sin_cache: torch.Tensor, head_dim: int):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        heads = x.view(x.shape[0], x.shape[1:].numel() // head_dim, head_dim)  # [T, H, D]
        heads.copy_(_rotate(heads, cos, sin))
    return q, k


def _check_rotary(positions, q, k, cos_sin_cache, head_dim) -> None:
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, head_dim={head_dim}] with an even "
                         f"head_dim, got {tuple(cos_sin_cache.shape)}")
    num_tokens = positions.shape[0]
    for name, x in (("q", q), ("k", k)):
        per_token = x.shape[1:].numel()
        if x.dim() not in (2, 3) or x.shape[0] != num_tokens or per_token % head_dim:
            raise ValueError(f"{name} must be [T={num_tokens}, heads * {head_dim}] or "
                             f"[T, heads, {head_dim}], got {tuple(x.shape)}")
        # Heads are packed inside a token; the token stride is free (q may be a slice of qkv).
        packed = x.stride(-1) == 1 and (x.dim() == 2 or x.stride(1) == head_dim)
        if not packed:
            raise ValueError(f"{name} must have its heads packed inside a token, "
                             f"got strides {x.stride()}")


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_sin_cache: torch.Tensor, head_dim: int, *,
                      use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding, in place. positions: [T] int; q: [T, Hq * D] or [T, Hq, D];
    k: [T, Hk * D] or [T, Hk, D]; cos_sin_cache: [max_pos, D] = cat([cos, sin]) per position.
    Returns (q, k), rotated."""
    _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    if not _pick_triton(q, use_triton):
        return rotary_embedding_torch_(positions, q, k, cos_sin_cache, head_dim)
    if not cos_sin_cache.is_contiguous() or not positions.is_contiguous():
        raise ValueError("cos_sin_cache and positions must be contiguous")
    _kernels("rotary").rotary_embedding_triton_(positions, q, k, cos_sin_cache, head_dim)
    return q, k


def rotary_store_torch_(positions, q, k, v, cos_sin_cache, head_dim, k_cache, v_cache, slots):
    rotary_embedding_torch_(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = k.shape[0]
    k_cache[slots] = k.reshape(num_tokens, *k_cache.shape[1:]).to(k_cache.dtype)
    v_cache[slots] = v.reshape(num_tokens, *v_cache.shape[1:]).to(v_cache.dtype)


def rotary_embedding_store_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *,
                            use_triton: bool | None = None) -> None:
    """rotary_embedding_ on q and k, then k and v written to the paged caches at `slots` ([T];
    caches [num_slots, Hk, D], contiguous). Triton does all three in one launch, where rotary
    and the two indexed writes took three (the writes were two of the 13 kernels of a decoder
    layer's decode step on the H100)."""
    _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    num_tokens, kv_size = k.shape[0], k.shape[1:].numel()
    if v.shape[0] != num_tokens or v.shape[1:].numel() != kv_size or v.stride(-1) != 1:
        raise ValueError(f"v must be [T={num_tokens}, {kv_size}] with packed heads, got "
                         f"{tuple(v.shape)} strides {v.stride()}")
    if slots.shape[0] != num_tokens or k_cache.shape[1:].numel() != kv_size:
        raise ValueError(f"slots must be [T={num_tokens}] and the caches [slots, {kv_size}], got "
                         f"{tuple(slots.shape)} and {tuple(k_cache.shape)}")
    if not _pick_triton(q, use_triton):
        return rotary_store_torch_(positions, q, k, v, cos_sin_cache, head_dim, k_cache,
                                   v_cache, slots)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
            and cos_sin_cache.is_contiguous() and positions.is_contiguous()):
        raise ValueError("caches, slots, cos_sin_cache and positions must be contiguous")
    v2 = v.view(num_tokens, kv_size) if v.dim() == 3 else v
    _kernels("rotary").rotary_store_triton_(positions, q, k, v2, cos_sin_cache, head_dim,
                                            k_cache, v_cache, slots)


# ---- SiLU and mul ----------------------------------------------------------------------------

def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                 use_triton: bool | None = None) -> torch.Tensor:
    """gate_up: [..., 2 * I] (gate first, up second) -> silu(gate) * up: [..., I]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate; up), got {tuple(gate_up.shape)}")
    inter_size = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], inter_size)
    if not _pick_triton(gate_up, use_triton):
        y = silu_and_mul_torch(gate_up)
        return y if out is None else _check_out(out, shape, y.dtype, y.device, "out").copy_(y)
    out = _check_out(out, shape, gate_up.dtype, gate_up.device, "out")
    _kernels("activation").silu_and_mul_triton(_rows(gate_up), out.view(-1, inter_size))
    return out
