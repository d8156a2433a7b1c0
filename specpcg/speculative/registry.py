"""Draft workers by name, and the few things of the engine a draft may use.

The engine never imports a draft package: packages register their factories here
(`register_draft`), and the first lookup of an unknown name imports the packages named in
DRAFT_PACKAGES (the project's own `drafts`), whose import registers them. So imports keep
running one way: drafts -> specpcg.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

DRAFT_PACKAGES = ("drafts",)
_FACTORIES: dict = {}


@dataclass
class DraftContext:
    """What a draft is handed instead of the engine: the target and the settings it runs
    under. `kv_cache` (the target's) is set once the engine sized it, before `setup`.
    `parallel`: under tensor parallelism, rank 0's TPDriver, through which a draft sharded like
    the target has every rank of rank 0's stage run its forwards (None on one process)."""

    spec: Any  # SpecConfig
    config: Any  # EngineConfig
    model: torch.nn.Module  # the target
    model_config: Any  # the target's ModelConfig
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    context_len: int
    kv_cache: Optional[Any] = None
    parallel: Optional[Any] = None


def register_draft(name: str, factory: Callable[[DraftContext], Any]) -> None:
    _FACTORIES[name] = factory


def create_draft(ctx: DraftContext):
    name = ctx.spec.algorithm
    if name not in _FACTORIES:
        for package in DRAFT_PACKAGES:
            importlib.import_module(package)
    if name not in _FACTORIES:
        raise ValueError(f"speculative_algorithm {name!r} has no draft worker (registered: "
                         f"{sorted(_FACTORIES)})")
    return _FACTORIES[name](ctx)
