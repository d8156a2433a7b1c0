"""The process group of a tensor-parallel engine and its two collectives."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from specpcg.graphs.breakable import eager_break


def free_init_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


_CONTROL = None  # the group rank 0's step messages travel on (gloo, on the host)
# Ranks wait for the next step as long as the engine idles: a server may see no request for
# hours. A message wait bounded by dist_timeout_s ended every other rank of an engine idle
# that long. A rank that dies still shows at once: rank 0 checks its ranks before each send,
# and a closed connection fails the send.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


def init_group(init_addr: str, rank: int, world_size: int, device: torch.device,
               timeout_s: float) -> None:
    """The process group (NCCL on GPUs, gloo on CPU; collectives time out after timeout_s)
    and the control group of step messages (gloo with no practical time limit, so a message
    moves no tensor through the GPU and costs it no synchronisation)."""
    global _CONTROL
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _CONTROL = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def broadcast_message(msg=None):
    """Rank 0's `msg` on every rank (rank 0 passes it, the others receive it)."""
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def gather_to_rank0(obj):
    """Every rank's `obj` in rank order on rank 0 (None on the others)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_CONTROL)
    return out


_TP_GROUP = None  # this rank's tensor-parallel group (None: every rank)


def init_tp_groups(tp: int, pp: int) -> None:
    """One tensor-parallel group per pipeline stage (ranks k * tp .. k * tp + tp - 1 run one
    stage). Every rank creates every group, in the same order, as torch.distributed requires."""
    global _TP_GROUP
    if pp == 1:
        _TP_GROUP = None
        return
    for s in range(pp):
        ranks = list(range(s * tp, (s + 1) * tp))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            _TP_GROUP = group


@eager_break(per_call=True)
def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the tensor-parallel ranks, in place (row-parallel layers,
    vocab-parallel embedding). A graph break: piecewise graphs run it between segments, each
    call into staged buffers of its own (its result is the residual stream, read after the
    next all-reduce)."""
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dim (vocab-parallel logits), in rank
    order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group=_TP_GROUP))]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)

