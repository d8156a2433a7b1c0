"""Which implementation an op runs: its Triton kernel or its torch twin.

Every op in `kernels/` that has a Triton kernel also has a torch twin (the readable reference)
and a dispatcher with a `use_triton` argument:

- `None` (default): Triton for CUDA tensors (when triton is installed), the twin otherwise;
- `True`: Triton; a CPU tensor needs TRITON_INTERPRET=1 set before the kernels are first
  imported (tests);
- `False`: the twin (benchmarks, debugging).

Triton modules are imported lazily, on the first Triton call, so `import kernels.<op>` works on a
machine without triton and the interpreter flag is read when the kernels are first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def pick_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """True when the op on `x` should run its Triton kernel (see the module docstring)."""
    if use_triton is None:
        return x.is_cuda and HAS_TRITON
    if use_triton and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"use_triton=True on a {x.device.type!r} tensor needs the Triton "
                         "interpreter: set TRITON_INTERPRET=1 before kernels are first imported")
    return bool(use_triton)


def triton_module(name: str) -> ModuleType:
    """The Triton module `kernels.<name>`, imported on first use."""
    return importlib.import_module(f"{__package__}.{name}")
