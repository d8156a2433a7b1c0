"""The host's side of a generate under the torch profiler (CUDA only): what it asks the CUDA
runtime each decode step, how long it waits on the device, and how far ahead of the device it
launches each step's graph.

A step's graph runs its first kernel some time after the host's cudaGraphLaunch: when the host
is ahead that lead is the time the device still had queued (hundreds of microseconds at batch
64); when the lead is a few microseconds the device waited on the host. The host's waits
(cudaEventSynchronize, cudaStreamSynchronize, a synchronous cudaMemcpy) say where it caught
up with the device. The profiler's own bookkeeping slows the host (a few microseconds an op),
so the leads are lower bounds and the runtime calls' times upper bounds.
"""

from __future__ import annotations

import bisect
import collections
import re
import statistics

import torch

WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
         "cudaMemcpy", "cudaHostAlloc", "cudaStreamWaitEvent")


def trace_host(run):
    """The profiler's events of run() with the host's activity: (runtime calls, kernels), each
    a list of (name, start us, end us) in start order."""
    from torch.profiler import ProfilerActivity, profile

    from probe_step_trace import cuda_kernels

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    # the runtime's calls, named without a version suffix
    calls = [(re.sub(r"_v\d+$", "", e.name), e.time_range.start, e.time_range.end)
             for e in prof.events()
             if e.device_type.name != "CUDA" and e.name.startswith("cuda")]
    return sorted(calls, key=lambda r: r[1]), cuda_kernels(prof)


def graph_leads(calls: list, kernels: list, first_name: str) -> list:
    """For each start of `first_name` (the decode graph's marker kernel,
    probe_decode_trace.step_marker) on the device, the time since the last cudaGraphLaunch
    before it, in us: the launch that ran it (a prefill's piecewise launches come before its
    first decode step; with overlap, step n + 2 is launched only after step n's tokens were
    read, by when step n + 1's first kernel has started)."""
    launches = [t for name, t, _ in calls if name == "cudaGraphLaunch"]
    leads = []
    for start in (k[1] for k in kernels if k[0] == first_name):
        i = bisect.bisect_left(launches, start)
        if i:
            leads.append(start - launches[i - 1])
    return leads


def report_host(calls: list, kernels: list, first_name: str) -> None:
    """Per decode step (counted by the graph's marker kernel): each runtime call's count and
    time (a prefill's among them), the waits among them, and the launches' lead on the
    device."""
    steps = sum(1 for k in kernels if k[0] == first_name)
    if steps < 4:
        print(f"# host: only {steps} decode steps")
        return
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in calls:
        per[name][0] += 1
        per[name][1] += e - s
    launches = sum(1 for c in calls if c[0] == "cudaGraphLaunch")
    print(f"# host: {steps} decode steps, {launches} graph launches; runtime calls a step "
          f"(count, us):")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
        mark = "  (waits)" if name in WAITS else ""
        print(f"  {n / steps:6.2f} {us / steps:8.1f}  {name}{mark}")
    leads = graph_leads(calls, kernels, first_name)
    if leads:
        q = statistics.quantiles(leads, n=10)
        print(f"# graph launch -> its first kernel on the device: median "
              f"{statistics.median(leads):.1f} us, p10 {q[0]:.1f}, p90 {q[-1]:.1f} "
              f"({sum(1 for x in leads if x < 30)} of {len(leads)} under 30 us: the device "
              f"waited on the host)")
