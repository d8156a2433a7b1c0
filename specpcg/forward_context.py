"""The one ambient forward context: the live batch and attention backend of the forward in flight.

Attention reads it instead of taking the batch as an argument, so a captured graph segment never
bakes in a batch's lengths (the piecewise runner replays the dense parts, attention stays eager).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

from specpcg.core import ForwardBatch


@dataclass
class ForwardContext:
    batch: ForwardBatch
    attn_backend: object  # specpcg.attention.base.AttentionBackend
    num_tokens: int  # real (unpadded) token count


_current: contextvars.ContextVar = contextvars.ContextVar("specpcg_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext):
    if _current.get() is not None:
        raise RuntimeError("forward_context is already active: nested forwards are not supported")
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("attention called outside forward_context(); run the model via ModelRunner")
    return ctx


def current_forward_context() -> ForwardContext | None:
    """The forward context in flight, or None outside one (a dense forward of a test or a
    trainer, whose attention is its own)."""
    return _current.get()
