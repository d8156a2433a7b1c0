"""The host's cost of a decode step's two small copies (CUDA only): its packed inputs to the
device and its tokens back, as the engine makes them and from pinned buffers kept for reuse.

A batch-1 decode step of the default model waits on the host in most engines (docs/
PERFORMANCE.md, "Batch-1 no-spec decode waits on the host"), and two of the host's phases are
these copies: `make_batch` (which ends in the inputs' copy) and `host_copy`, 64-99 us a step on
an H200. Each now takes a fresh pinned block from PyTorch's caching host allocator (and the
token copy a new CUDA event); kept buffers take none. Each case, and each part of one, runs
--calls times in turn, --rounds rounds, while the stream has work queued (small matmuls before
each call, as a step's copies queue behind the step before), the device drained between calls
outside the timer; a line gives the host's microseconds a call to queue it.

    python benchmarks/probe_pinned.py [--calls 2000] [--rounds 3] [--values 6] > out.txt
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import common

common.add_repo_to_path()


def cases(values: int, dev) -> dict:
    """{name: a call}: each queues the copy of `values` int64s one way, or one part of it."""
    from specpcg.transfer import HostCopy, to_device

    ints = np.arange(values, dtype=np.int64)
    src = torch.arange(values, device=dev)
    kept_host = torch.empty(values, dtype=torch.long, pin_memory=True)
    kept_event = torch.cuda.Event()

    def inputs_now():  # make_batch's copy: a pinned block, the async copy
        to_device(torch.from_numpy(ints), dev)

    def inputs_kept():  # a kept pinned buffer, written through numpy, a new device tensor
        kept_host.numpy()[:] = ints
        torch.empty(values, dtype=torch.long, device=dev).copy_(kept_host, non_blocking=True)
        kept_event.record()

    def tokens_now():
        HostCopy(src)

    def tokens_kept():
        kept_host.copy_(src, non_blocking=True)
        kept_event.record()

    return {"inputs: to_device": inputs_now, "inputs: kept buffer": inputs_kept,
            "tokens: HostCopy": tokens_now, "tokens: kept buffer": tokens_kept,
            "a pinned block alone": lambda: torch.empty(values, dtype=torch.long,
                                                        pin_memory=True),
            "a pinned copy (pin_memory)": lambda: torch.from_numpy(ints).pin_memory(),
            "a new event, recorded": lambda: torch.cuda.Event().record(),
            "a kept event, recorded": kept_event.record,
            "a device tensor (empty)": lambda: torch.empty(values, dtype=torch.long, device=dev),
            "a device copy (one launch)": lambda: src.clone()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--values", type=int, default=6)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    work = torch.randn(256, 256, device=dev)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.values} int64s "
          f"a copy, {args.calls} calls a case and round", flush=True)
    calls = cases(args.values, dev)
    for fn in calls.values():  # warm: first allocations, first events
        for _ in range(50):
            fn()
            torch.cuda.synchronize()
    for r in range(args.rounds):
        for name, fn in calls.items():
            spent = 0.0
            for _ in range(args.calls):
                for _ in range(4):  # the stream busy, as behind a step
                    work = work @ work * 1e-3
                start = time.perf_counter()
                fn()
                spent += time.perf_counter() - start
                torch.cuda.synchronize()  # a kept buffer is free again (the engine's next step)
            print(f"round {r}  {name:28s} {spent / args.calls * 1e6:7.2f} us a call", flush=True)


if __name__ == "__main__":
    main()
