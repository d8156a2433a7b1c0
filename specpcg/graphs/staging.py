"""Staging buffers shared by every break of every bucket of a breakable-graph runner.

Without them, each break's replay closure would pin its argument and output tensors, and so one
set of activations per layer per bucket (GBs for an 8B model over ~50 buckets). With them, a
break reads its tensor arguments from, and writes its output into, one buffer per (break
function, argument slot) sized for the largest bucket; the segment before the break copies the
arguments in, the segment after reads the output. Breaks run one at a time, so reuse is safe.
NOTE: the first dimension of every staged tensor must be the token dimension.
"""

from __future__ import annotations

import torch


class StagingArena:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._buffers: dict = {}

    def view(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """A [like.shape[0], ...] view of the buffer for `key`, allocated on first use."""
        full_key = (key, like.dtype, tuple(like.shape[1:]), like.device)
        buf = self._buffers.get(full_key)
        if buf is None:
            # Zeros, not empty: rows a break never writes (padding) must not hold NaN bits.
            buf = torch.zeros((self.max_tokens, *like.shape[1:]), dtype=like.dtype,
                              device=like.device)  # [max_tokens, ...]
            self._buffers[full_key] = buf
        if like.shape[0] > self.max_tokens:
            raise RuntimeError(f"a break staged {like.shape[0]} tokens but the arena holds "
                               f"{self.max_tokens}; size it for the largest bucket")
        return buf[:like.shape[0]]

    def stage_args(self, name: str, args: tuple) -> tuple:
        """Copies each tensor argument into its buffer (recorded in the open segment)."""
        staged = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                buf = self.view((name, "arg", i), a)
                buf.copy_(a)
                a = buf
            staged.append(a)
        return tuple(staged)

    def stage_output(self, name: str, out):
        """The buffers a break's output is copied into on every run (None stays None)."""
        if out is None:
            return None
        if isinstance(out, torch.Tensor):
            buf = self.view((name, "out", 0), out)
            buf.copy_(out)
            return buf
        return type(out)(self.stage_output(f"{name}.{i}", o) for i, o in enumerate(out))

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
