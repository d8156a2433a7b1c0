"""Host -> device copies that do not stall the host.

CUDA runs an async copy from pageable host memory only after the stream has drained, so a plain
`torch.tensor(values).to("cuda", non_blocking=True)` waits for every kernel queued before it: in
a spec step that is the draft's whole chain, and the host then builds the verify batch while the
GPU idles. Copies from pinned memory are queued like kernels; PyTorch's caching host allocator
keeps a pinned block until the copy that reads it has run, so no buffer is reused too early.
"""

from __future__ import annotations

import numpy as np
import torch


_NUMPY_INTS = {torch.long: np.int64, torch.int32: np.int32}


def host_tensor(values, dtype=torch.long) -> torch.Tensor:
    """A CPU tensor of a list of ints (or of equal-length lists). Through numpy for integer
    dtypes: torch.tensor reads a Python list about 3x slower (a 4,096-token prefill builds two
    lists of about 12,000 ints)."""
    np_dtype = _NUMPY_INTS.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def runs(starts: list, counts: list) -> np.ndarray:
    """int64 [sum(counts)]: start, start + 1, ... (count of them) for each (start, count) in
    turn: a batch's positions, or the req_to_token columns its new slots go to."""
    total = sum(counts)
    if total <= 4 * len(counts):  # decode, a short verify: a list is cheaper than numpy calls
        return np.array([p for s, n in zip(starts, counts) for p in range(s, s + n)],
                        dtype=np.int64)
    # NOTE: a long prefill is thousands of tokens: no Python-level pass over them here.
    shift = np.asarray(starts, dtype=np.int64) - (np.cumsum(counts) - np.asarray(counts))
    return np.repeat(shift, counts) + np.arange(total)


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """values: a list (of ints, or of equal-length lists) or a tensor; returns it on `device`.
    A CPU tensor's copy to CUDA is queued on the current stream without a host sync."""
    host = values if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# Pinned buffers (and their events) a HostCopy of one shape, dtype and device takes in turn.
# Each copy is read by the step after it, so the fourth copy after it may take its buffer: a
# fresh pinned block and a new event a copy took 40-53 us of the host's time on an H200, kept
# ones 20-28 (benchmarks/probe_pinned.py), in a batch-1 decode step whose host work (about 460
# us) sets its pace.
KEPT_COPIES = 4


class _Kept:
    """A shape's pinned buffers and events, and which copy took each last."""

    def __init__(self, shape, dtype):
        self.slots = [(torch.empty(shape, dtype=dtype, pin_memory=True), torch.cuda.Event())
                      for _ in range(KEPT_COPIES)]
        self.taken = [0] * KEPT_COPIES  # the serial of the copy in each slot
        self.serial = 0

    def take(self) -> tuple:
        self.serial += 1
        i = self.serial % KEPT_COPIES
        self.taken[i] = self.serial
        return i, self.serial, *self.slots[i]


_kept: dict = {}


class HostCopy:
    """A device tensor's copy to the host, queued now and read later without waiting for
    whatever the stream runs after it.

    `tensor.tolist()` on a CUDA tensor waits for the whole stream: under overlap scheduling that
    is the next step too, already queued behind it, and the host would then prepare the step
    after with the device idle. Here the copy goes to pinned memory and an event marks its end,
    so `tolist()` waits for exactly the work queued before the copy. The pinned buffer and the
    event are kept ones (KEPT_COPIES): a copy must be read before KEPT_COPIES more of its shape
    are made, or its read raises."""

    def __init__(self, values: torch.Tensor):
        self._done = self._kept = None
        if values.device.type != "cuda":
            self._host = values.clone()  # a snapshot: `values` may be a buffer reused next step
            return
        key = (tuple(values.shape), values.dtype, values.device)
        if key not in _kept:
            _kept[key] = _Kept(values.shape, values.dtype)
        self._kept = _kept[key]
        self._slot, self._serial, self._host, self._done = self._kept.take()
        self._host.copy_(values, non_blocking=True)
        self._done.record()

    def tolist(self) -> list:
        if self._kept is not None and self._kept.taken[self._slot] != self._serial:
            raise RuntimeError(
                f"a device-to-host copy of shape {tuple(self._host.shape)} was read after "
                f"{KEPT_COPIES} newer copies of that shape reused its pinned buffer")
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
