"""Host -> device copies that do not stall the host.

CUDA runs an async copy from pageable host memory only after the stream has drained, so a plain
`torch.tensor(values).to("cuda", non_blocking=True)` waits for every kernel queued before it: in
a spec step that is the draft's whole chain, and the host then builds the verify batch while the
GPU idles. Copies from pinned memory are queued like kernels; PyTorch's caching host allocator
keeps a pinned block until the copy that reads it has run, so no buffer is reused too early.
"""

from __future__ import annotations

import torch


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """values: a list (of ints, or of equal-length lists) or a CPU tensor; returns it on
    `device`. On CUDA the copy is queued on the current stream without a host sync."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
