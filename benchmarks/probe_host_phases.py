"""Where the host's time of an overlapped decode step goes, engine after engine in one process.

probe_engine_swing.py showed batch-1 no-spec decode bound by the host in most engines on an
H200, by an amount that differs from engine to engine. Here each phase of the scheduler's
overlapped decode step is wrapped in a perf_counter timer (building the batch, the forward and
in it the graph's input load and replay, sampling, the token's pinned copy, the wait for the
step before and the append of its tokens), and every engine reports its decode rate and each
phase's microseconds a step (calls a step in brackets). A phase that grows with a slow engine
is the host's lever; `tolist_wait` is time the host spent waiting for the device, not working.

    python benchmarks/probe_host_phases.py [--engines 6] [--batch 1] > out.txt
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import common

common.add_repo_to_path()

TIMES: dict = collections.defaultdict(lambda: [0, 0.0])  # phase -> [calls, seconds]


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name][0] += 1
            TIMES[name][1] += time.perf_counter() - start
    return wrapper


def install_timers(patch=setattr) -> None:
    """Wraps each phase where the overlapped step looks it up (names a module imports are
    replaced in that module). patch: setattr, or a test's monkeypatch.setattr."""
    import torch

    import specpcg.batch as batch
    import specpcg.overlap as overlap
    import specpcg.transfer as transfer
    from specpcg.graphs.decode_runner import DecodeGraphRunner
    from specpcg.scheduler import Scheduler

    for owner, attr, name in (
            (overlap.OverlapDecode, "step", "step"), (overlap.OverlapDecode, "_resolve", "resolve"),
            (overlap, "sample", "sample"), (batch, "make_batch", "make_batch"),
            (Scheduler, "plain_forward", "plain_forward"),
            (Scheduler, "_append_and_finish", "append"),
            (DecodeGraphRunner, "_padded_batch", "graph_inputs"),
            (torch.cuda.CUDAGraph, "replay", "graph_replay")):
        patch(owner, attr, timed(name, getattr(owner, attr)))
    patch(overlap, "HostCopy", type("HostCopy", (transfer.HostCopy,), {
        "__init__": timed("host_copy", transfer.HostCopy.__init__),
        "tolist": timed("tolist_wait", transfer.HostCopy.tolist)}))


def report(label: str, rates: list) -> str:
    steps = TIMES["step"][0] or 1
    phases = sorted(TIMES.items(), key=lambda kv: -kv[1][1])
    return (f"{label}: rates {' '.join(f'{r:.0f}' for r in rates)}; us a step: "
            + ", ".join(f"{name} {secs / steps * 1e6:.0f} ({calls / steps:.2f})"
                        for name, (calls, secs) in phases))


def one_engine(i: int, batch_size: int, model_path: str | None) -> None:
    from bench_accept import close
    from probe_engine_swing import decode_engine, decode_rate

    engine, run = decode_engine(i, batch_size, model_path)
    TIMES.clear()
    rates = [decode_rate(engine, run) for _ in range(4)]
    print(report(f"engine {i}", rates), flush=True)
    close(engine)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model-path", default=None)
    args = p.parse_args(argv)
    install_timers()
    for i in range(args.engines):
        one_engine(i, args.batch, args.model_path)


if __name__ == "__main__":
    main()
