"""enable_deterministic_inference: the target's linear layers and LM head as batch-invariant
matmuls (kernels/matmul.py). Attention is batch-invariant in every mode (fixed decode splits);
RMSNorm, rotary and SiLU-and-mul work row by row. So a request's greedy tokens are the same
whatever batch it shares, with speculative decoding on or off."""

from __future__ import annotations

from torch import nn

from kernels.fused_ops import silu_and_mul
from kernels.matmul import invariant_linear
from specpcg.models.layers import Linear


class InvariantLinear(nn.Linear):
    def forward(self, x):
        return invariant_linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x):  # a gated MLP's [gate; up] projection (layers.Linear's)
        return silu_and_mul(self(x))


def make_batch_invariant(model: nn.Module) -> int:
    """Swaps every nn.Linear of `model` (same parameters; layers.Linear's one-row GEMV too)
    and its LM head's matmul; returns how many layers it swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) in (nn.Linear, Linear):
            module.__class__ = InvariantLinear
            swapped += 1
    model.head_linear = invariant_linear
    return swapped
