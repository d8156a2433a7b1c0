"""enable_deterministic_inference: the target's linear layers and LM head as batch-invariant
matmuls (kernels/matmul.py). Attention is batch-invariant in every mode (fixed decode splits);
RMSNorm, rotary and SiLU-and-mul work row by row. So a request's greedy tokens are the same
whatever batch it shares, with speculative decoding on or off."""

from __future__ import annotations

from torch import nn

from kernels.matmul import invariant_linear


class InvariantLinear(nn.Linear):
    def forward(self, x):
        return invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> int:
    """Swaps every nn.Linear of `model` (same parameters) and its LM head's matmul; returns how
    many layers it swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = InvariantLinear
            swapped += 1
    model.head_linear = invariant_linear
    return swapped
