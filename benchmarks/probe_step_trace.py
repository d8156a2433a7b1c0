"""The kernels of one overlapped speculative step, in order (CUDA only).

An engine with a random EAGLE3 head (or NGRAM) at (7, 1, 8) (or --setting: a tree, topk > 1)
and synthetic acceptance decodes repeated-id prompts; one replay of the speculative step graph
at the given batch size runs under the torch profiler, and its kernels are printed in launch
order, runs of the same kernel folded: start (us from the first), count, summed own time
(probe_decode_trace.own_times), name.
The draft's steps, the verify's layers and the accept stand apart by their kernels, so the
launches each phase costs can be counted. Then each kernel's count and time, the target's
matmuls at batch x draft tokens rows a call (NGRAM's steps; a head's own matmuls make the count
differ, and the kinds are not printed), and a whole
generate under the profiler (probe_decode_trace's window): a step's period, busy and idle time,
and the kernels that run outside the step's graph.

    python benchmarks/probe_step_trace.py --batch 1 [--algorithm NGRAM] [--setting 5,4,8] > out.txt
    python benchmarks/probe_step_trace.py --plot OUT.png LABEL=TRACE.txt ...   (busy us, kernels)
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import torch

import common

common.add_repo_to_path()
from accept_prompts import repeated_id_prompts  # noqa: E402
from bench_spec_overlap import random_head  # noqa: E402


def cuda_kernels(prof) -> list:
    """(name, start us, end us) of every CUDA kernel a torch profiler saw, in start order."""
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.time_range.start, e.time_range.end)
            for e in sorted(kernels, key=lambda e: e.time_range.start)]


def trace_first_call(cls, method: str, wanted, run) -> list:
    """The kernels of the first call of cls.method whose arguments `wanted` accepts, while
    run() runs (the method is patched for that time only)."""
    from torch.profiler import ProfilerActivity, profile

    original, events = getattr(cls, method), []

    def traced(self, *args):
        if events or not wanted(*args):
            return original(self, *args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = original(self, *args)
            torch.cuda.synchronize()
        events.extend(cuda_kernels(prof))
        return out

    setattr(cls, method, traced)
    try:
        run()
    finally:
        setattr(cls, method, original)
    return events


def trace_one_step(engine, bs: int, run) -> list:
    """(name, start us, end us) of every kernel of the first step replay at batch bs."""
    from specpcg.speculative import step_graph

    return trace_first_call(step_graph.SpecStepGraphs, "run", lambda b, *_: b == bs, run)


def plot_traces(path: str, traces: list) -> None:
    """A bar plot of saved traces (LABEL=FILE, each this script's output): a step's kernel time
    and kernel count, from each file's summary line."""
    import re

    labels, busy, kernels = [], [], []
    for item in traces:
        label, file = item.split("=", 1)
        head = next(line for line in open(file) if not line.startswith("#"))
        m = re.search(r"(\d+) kernels, span \d+ us, busy (\d+) us", head)
        labels.append(label)
        kernels.append(float(m.group(1)))
        busy.append(float(m.group(2)))
    panels = [{"title": "kernel time a step", "ylabel": "us", "labels": labels,
               "values": {"step": busy}},
              {"title": "kernels a step", "ylabel": "kernels", "labels": labels,
               "values": {"step": kernels}}]
    common.grouped_bar_plot(panels, ["step"], path, "One speculative step's kernels")


def main(argv=None) -> None:
    from bench_reference import copy_bandwidth
    from probe_decode_trace import (own_times, print_by_kernel, print_matmuls, report_window,
                                    step_marker, trace_window)
    from specpcg import Engine
    from specpcg.models.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE3", "NGRAM"])
    p.add_argument("--model-path", default=None)
    p.add_argument("--setting", default="7,1,8", help="steps,topk,draft tokens (a tree: topk > 1)")
    p.add_argument("--prob", type=float, default=0.7, help="synthetic acceptance")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="plot saved traces given as LABEL=FILE arguments instead of tracing")
    p.add_argument("traces", nargs="*", default=[])
    args = p.parse_args(argv)
    if args.plot:
        return plot_traces(args.plot, args.traces)
    steps, topk, num_tokens = common.parse_setting(args.setting)
    path = args.model_path or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        head = None if args.algorithm == "NGRAM" else random_head(path, tmp)
        engine = Engine(model_path=path, speculative_algorithm=args.algorithm,
                        speculative_draft_model_path=head, speculative_num_steps=steps,
                        speculative_eagle_topk=topk, speculative_num_draft_tokens=num_tokens,
                        speculative_simulate_accept_prob=args.prob, show_progress=False,
                        skip_tokenizer_init=True, max_running_requests=args.batch,
                        cuda_graph_max_bs=args.batch, **common.PINNED_SPEC)
        ids = repeated_id_prompts(args.batch, 128, 32, engine.model_config.vocab_size)
        params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        run = lambda: engine.generate(input_ids=ids, sampling_params=params)  # noqa: E731
        run()  # warm-up
        events = trace_one_step(engine, args.batch, run)
        window = trace_window(run)
    t0, own = events[0][1], own_times(events)
    busy = sum(e[2] - e[1] for e in own)
    print(f"batch {args.batch} {args.algorithm} {args.setting}: {len(events)} kernels, span "
          f"{max(e[2] for e in events) - t0:.0f} us, busy {busy:.0f} us")
    for name, group in itertools.groupby(own, key=lambda e: e[0][:60]):
        g = list(group)
        print(f"  {g[0][1] - t0:8.1f} {len(g):3d}x {sum(e[2] - e[1] for e in g):7.1f}us  {name}")
    print_by_kernel(events)
    # A verify's matmuls run batch x draft tokens rows a call (NGRAM: the target's alone).
    print_matmuls(own, engine.model, copy_bandwidth(torch.device("cuda")),
                  args.batch * num_tokens)
    graph = [e[0] for e in events]
    report_window(window, set(graph), step_marker(graph, window), busy)


if __name__ == "__main__":
    main()
