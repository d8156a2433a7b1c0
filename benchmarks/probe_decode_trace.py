"""Where a plain decode step's device time goes (CUDA only): one replay of the decode graph at
--batch under the torch profiler, its kernels in launch order, and the weight bandwidth each
matmul reached.

An engine without speculation decodes random-id prompts; the first decode-graph replay at the
batch size after a warm-up generate is traced. The lines give the step's span, its busy time
(the kernels' own time, `own_times`: with programmatic dependent launch a kernel's duration
includes its wait for the one before) and the idle time between kernels; then each kernel
kind's count and own time; then the first layer's kernels in order; then the matmuls (counted
in launch order against the model's weights: qkv, o, gate_up, down per layer, then the LM head)
with the bytes each read per microsecond of its own time, against a device-to-device copy's
rate, and the FLOP rate its rows reached (`print_matmuls`). Last, a whole generate
under the profiler: the period of a decode step, its busy and idle time, and the kernels that
run outside the graph each step.

With --algorithm and --draft the engine carries that draft, held to plain steps (bench_adaptive's
`plain` system): what a plain step costs beside no-spec's (the hidden states kept for the draft);
with --adaptive as well, left to choose (the controller's host work between steps).

    python benchmarks/probe_decode_trace.py --model-path shape:llama-3-8b --batch 1 > out.txt
    python benchmarks/probe_decode_trace.py --batch 64 --algorithm EAGLE3 --draft DIR
    python benchmarks/probe_decode_trace.py --batch 1 --algorithm EAGLE3 --untrained

--host adds a generate traced with the host's activity too: its CUDA runtime calls a step, its
waits on the device, and how far ahead of the device each graph launch came (host_trace.py).
"""

from __future__ import annotations

import argparse
import collections
import random

import torch

import common

common.add_repo_to_path()
from bench_reference import copy_bandwidth  # noqa: E402
from probe_step_trace import cuda_kernels, trace_first_call  # noqa: E402

MATMUL_MARKS = ("gemv", "gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")


def own_times(events: list) -> list:
    """(name, own start us, end us) of each kernel in start order: its own time runs from its
    start or the end of every kernel before it, whichever is later. A kernel launched early
    (programmatic dependent launch, kernels/dispatch.pdl) waits inside its duration for the one
    before: summed durations then count those waits twice (a step's kernels summed to more than
    its span, H200, e8752dc), and a matmul's bandwidth by its duration came out a tenth of the
    copy rate. Own times sum to the time some kernel ran; a kernel wholly inside others' gets
    none."""
    out, last_end = [], float("-inf")
    for name, s, e in events:
        begin = max(s, last_end)
        out.append((name, begin, max(e, begin)))
        last_end = max(last_end, e)
    return out


def trace_one_replay(bs: int, run) -> list:
    """(name, start us, end us) of every kernel of the first decode-graph replay at batch bs."""
    from specpcg.core import ForwardMode
    from specpcg.graphs.decode_runner import DecodeGraphRunner

    return trace_first_call(DecodeGraphRunner, "forward", lambda batch: (
        batch.batch_size == bs and batch.forward_mode == ForwardMode.DECODE), run)


def trace_window(run) -> list:
    """(name, start us, end us) of every kernel of a whole generate, in start order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return cuda_kernels(prof)


def step_marker(graph: list, window: list) -> str:
    """The kernel that counts steps: one the graph launches once per replay and the rest of the
    generate the least (a kernel the host also launches outside the graph, such as the indexed
    write a replay now starts with, counted three steps for each one at a9a826b)."""
    counts = collections.Counter(e[0] for e in window)
    once = [n for n, c in collections.Counter(graph).items() if c == 1 and counts[n] >= 4]
    return min(once, key=lambda n: counts[n]) if once else graph[0]


def report_window(events: list, step_kernels: set, first_name: str,
                  replay_us: float = 0.0) -> None:
    """Steps are counted by `first_name` (step_marker); from the second step to the last, the
    period between steps, the kernels' busy time, and each kernel outside the graph per step.
    replay_us: the traced replay's busy time; marks less than half of it apart count something
    other than steps (a batch-16 decode window of the 8B shape read 639 us a step where one
    replay's kernels took 4,949), and no period is printed."""
    starts = [i for i, e in enumerate(events) if e[0] == first_name]
    if len(starts) < 4:
        print(f"# window: only {len(starts)} steps found")
        return
    window = own_times(events[starts[1]:starts[-1]])
    steps = len(starts) - 2
    span = events[starts[-1]][1] - events[starts[1]][1]  # marker to marker: whole periods
    if span / steps < replay_us / 2:
        print(f"# window: {steps} marks of {first_name[:40]}, {span / steps:.1f} us apart, under "
              f"half a replay's kernels ({replay_us:.0f} us): not a step's period")
        return
    busy = sum(e[2] - e[1] for e in window)
    print(f"# window: {steps} steps, {span / steps:.1f} us a step, busy {busy / steps:.1f} us, "
          f"idle {(span - busy) / steps:.1f} us a step (kernels' own time)")
    print_step_idle(events, starts)
    outside = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in window:
        if name not in step_kernels:
            outside[name[:90]][0] += 1
            outside[name[:90]][1] += e - s
    for name, (n, us) in sorted(outside.items(), key=lambda kv: -kv[1][1]):
        print(f"  outside the graph: {n / steps:5.2f} a step, {us / steps:6.1f} us a step  {name}")
    gaps = collections.Counter()
    for a, b in zip(window, window[1:]):
        if b[1] - a[2] > 20:
            gaps[f"{a[0][:40]} -> {b[0][:40]}"] += b[1] - a[2]
    for name, us in gaps.most_common(6):
        print(f"  gaps over 20 us: {us / steps:6.1f} us a step  {name}")


def step_idle(events: list, starts: list) -> list:
    """Each whole step's idle time (us): its period less its kernels' own time."""
    out = []
    for a, b in zip(starts[1:], starts[2:]):
        own = own_times(events[a:b])
        out.append(events[b][1] - events[a][1] - sum(e[2] - e[1] for e in own))
    return out


def print_step_idle(events: list, starts: list) -> None:
    """Whether idle time comes every step or in a few long waits."""
    idle = sorted(step_idle(events, starts))
    if idle:
        n = len(idle)
        print(f"  idle a step: median {idle[n // 2]:.1f} us, p90 {idle[int(0.9 * (n - 1))]:.1f}, "
              f"most {idle[-1]:.1f}; {sum(1 for x in idle if x > 100)} of {n} steps over 100 us")


def weight_bytes_in_order(model) -> list:
    """(name, bytes) of each matmul's weight in a decode step's launch order."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for name, lin in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                          ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            out.append((f"{i}.{name}", lin.weight.numel() * lin.weight.element_size()))
    head = model.head_weight
    out.append(("lm_head", head.numel() * head.element_size()))
    return out


def is_matmul(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in MATMUL_MARKS)


def print_by_kernel(events: list) -> None:
    """Each kernel's count and summed own time (own_times), the costliest first."""
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in own_times(events):
        kinds[name[:90]][0] += 1
        kinds[name[:90]][1] += e - s
    print("# by kernel: count, us, name")
    for name, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:5d} {us:9.1f}  {name}")


def matmul_sums(own: list, weights: list) -> dict:
    """{kind: [weight bytes, us]} over a step's matmul kernels (own times), matched in launch
    order to `weights` (weight_bytes_in_order); {} when the counts differ."""
    mm = [e for e in own if is_matmul(e[0])]
    sums: dict = {}
    if len(mm) != len(weights):
        return sums
    for (wname, nbytes), (_, s, e) in zip(weights, mm):
        kind = sums.setdefault(wname.split(".", 1)[-1], [0, 0.0])
        kind[0] += nbytes
        kind[1] += e - s
    return sums


def print_matmuls(own: list, model, copy_bps: float, rows: int) -> None:
    """Each kind of matmul's weight bytes, time, bandwidth (against the copy rate) and, for
    `rows` rows a call, its FLOP rate (2 x rows x weights): a decode step's matmuls read their
    weights at a share of the copy rate, a verify's many rows can make them compute-bound."""
    weights = weight_bytes_in_order(model)
    mm = sum(is_matmul(e[0]) for e in own)
    print(f"# matmuls: {mm} kernels for {len(weights)} weights, {rows} rows a call")
    elem = model.head_weight.element_size()
    for key, (nbytes, us) in matmul_sums(own, weights).items():
        tflops = 2 * rows * nbytes / elem / us / 1e6
        print(f"  {key:8s} {nbytes / 1e6:9.1f} MB {us:9.1f} us "
              f"{nbytes / us / 1e3:6.0f} GB/s ({nbytes / us * 1e6 / copy_bps:.2f} of copy) "
              f"{tflops:6.1f} TFLOP/s")


def report(events: list, model, copy_bps: float, rows: int) -> float:
    """Prints the replay's kernels and matmuls; returns its busy time (us)."""
    own = own_times(events)
    t0, t1 = events[0][1], max(e[2] for e in events)
    busy = sum(e[2] - e[1] for e in own)
    summed = sum(e[2] - e[1] for e in events)
    print(f"# {len(events)} kernels, span {t1 - t0:.0f} us, busy {busy:.0f} us, "
          f"idle {t1 - t0 - busy:.0f} us (kernels' own time; durations sum to {summed:.0f} us); "
          f"copy {copy_bps / 1e9:.0f} GB/s")
    print_by_kernel(events)
    print_matmuls(own, model, copy_bps, rows)
    print("# the first layer's kernels (start us, duration us, name)")
    first = [i for i, e in enumerate(events) if is_matmul(e[0])]
    stop = first[4] if len(first) > 4 else len(events)
    for name, s, e in events[:stop + 1]:
        print(f"  {s - t0:8.1f} {e - s:7.1f}  {name[:110]}")
    gaps = sorted(((events[i + 1][1] - events[i][2], events[i][0][:50])
                   for i in range(len(events) - 1)), reverse=True)[:5]
    print("# widest gaps: " + "; ".join(f"{g:.1f} us after {n}" for g, n in gaps))
    return busy


def main(argv=None) -> None:
    from specpcg import Engine
    from specpcg.models.loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithm", default=None, help="a draft held to plain steps")
    p.add_argument("--draft", default=None)
    p.add_argument("--untrained", action="store_true",
                   help="the draft: bench_adaptive's untrained one for --algorithm")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="128 with 64 new tokens: probe_step_trace's contexts")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--adaptive", action="store_true",
                   help="the draft's engine left to choose its steps (not held to plain ones)")
    p.add_argument("--host", action="store_true",
                   help="then one more generate with the host's activity (host_trace.py)")
    args = p.parse_args(argv)
    from bench_adaptive import engine_kwargs, untrained_drafts
    from holds import plain_only

    if args.untrained:
        args.draft = untrained_drafts([args.algorithm], args.model_path)[args.algorithm]

    system = "adaptive" if args.adaptive else "plain"
    kw = engine_kwargs(system, args.algorithm, args.draft, (3, 1, 4)) if args.algorithm else {}
    engine = Engine(model_path=args.model_path or default_model_path(), show_progress=False,
                    skip_tokenizer_init=True, max_running_requests=args.batch,
                    cuda_graph_max_bs=args.batch, **kw)
    if args.algorithm and not args.adaptive:
        plain_only(engine)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    ids = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    run = lambda: engine.generate(input_ids=ids, sampling_params=params)  # noqa: E731
    run()  # warm-up
    events = trace_one_replay(args.batch, run)
    replay_us = report(events, engine.model, copy_bandwidth(torch.device("cuda")), args.batch)
    # The graph's kernels: from shortly before its first matmul (the embedding, the first norm).
    start = next(e[1] for e in events if is_matmul(e[0])) - 10
    graph = [e[0] for e in events if e[1] >= start]
    window = trace_window(run)
    marker = step_marker(graph, window)
    report_window(window, set(graph), marker, replay_us)
    if args.host:
        from host_trace import report_host, trace_host

        report_host(*trace_host(run), marker)


if __name__ == "__main__":
    main()
