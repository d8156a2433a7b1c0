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


def cuda_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


_pdl_devices: dict = {}


def pdl(x: torch.Tensor) -> dict:
    """Launch options for a kernel that takes a PDL constexpr: with programmatic dependent
    launch (Hopper on, unless SPECPCG_PDL=0), {"PDL": True, "launch_pdl": True}, else
    {"PDL": False}. Such a kernel may start while the kernel before it in the stream ends: it
    signals at once that the next may start too, reads only what nothing before it writes
    (weights) before its `gdc_wait`, and every program waits before any other read or write,
    so it never ends before the kernel before it did. A batch-1 decode step is a chain of about
    250 small kernels; a chain of the default model's one-row linear layers went from 2.3-2.6
    to 1.8 us a call on an H200 (benchmarks/probe_pdl.py), its no-spec decode from 1,317 to
    1,696 tok/s."""
    if not x.is_cuda:
        return {"PDL": False}
    index = cuda_index(x.device)
    if index not in _pdl_devices:
        _pdl_devices[index] = (os.environ.get("SPECPCG_PDL", "1") != "0"
                               and torch.cuda.get_device_capability(index)[0] >= 9
                               and _triton_has_pdl())
    return {"PDL": True, "launch_pdl": True} if _pdl_devices[index] else {"PDL": False}


def _triton_has_pdl() -> bool:
    """Whether this Triton has the grid-dependency calls (3.3 on); older ones launch plainly."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
