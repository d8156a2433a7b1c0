"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import fused_ops, gemv


class RMSNorm(nn.Module):
    """RMSNorm through one fused kernel on CUDA (its torch twin elsewhere; same rounding as HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where the result goes (a column block of a wider tensor: no concatenation)."""
        return fused_ops.rms_norm(x, self.weight, self.eps, out=out)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple:
        """(norm(x + residual), x + residual) in one kernel: the residual add fused in."""
        return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling) -> torch.Tensor:
    # float32 exactly as HF computes it: angles at long positions must match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Neox-layout rotary embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)

    def forward(self, positions, q, k):
        """q: [T, Hq, D] or [T, Hq * D], k likewise; rotated in place (and returned)."""
        return fused_ops.rotary_embedding_(positions, q, k, self.cos_sin, q.shape[-1]
                                           if q.dim() == 3 else self.head_dim)


class BucketedLinear(nn.Linear):
    """nn.Linear whose calls inside kernels.gemv.bucketed_rows (a draft's eager catch-up) run at
    a bucketed row count, one cuBLAS has met before (`warm_row_buckets`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.bucketed_linear(x, self.weight, self.bias)


class Linear(BucketedLinear):
    """nn.Linear whose one-row calls on CUDA (a batch-1 decode) take the GEMV kernel
    (kernels/gemv.py), which reads the weight faster than cuBLAS's tiles there; other calls
    are BucketedLinear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection (no bias): in the GEMV's epilogue
        where it applies, else the SiLU-and-mul kernel after the matmul."""
        return gemv.linear_silu_mul(x, self.weight)

    def forward_normed(self, x: torch.Tensor, residual, norm: RMSNorm,
                       silu_mul: bool = False) -> tuple | None:
        """(this layer over norm(x + residual), x + residual) with the norm in the GEMV's launch
        where it fits (kernels/gemv.normed_linear), else None: the caller runs the norm first."""
        return gemv.normed_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                  silu_mul)

    def forward_normed_rope(self, x: torch.Tensor, residual, norm: RMSNorm,
                            rope: tuple) -> tuple | None:
        """forward_normed of a qkv projection with the rotary and the K/V cache write in its
        launch too (kernels/gemv.normed_qkv_rope, `rope` as there), else None."""
        return gemv.normed_qkv_rope(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                    rope)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        # gate and up in one GEMM: [gate; up] rows (checkpoints are concatenated at load).
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_mul(x))
