"""Where a decoding step's time goes, host and device, at one or more batch sizes.

Per system (no-spec, or a draft pinned to speculate at (7, 1, 8): an EAGLE3 head from --draft,
a random EAGLE3 head or NGRAM with synthetic acceptance --prob) and batch size, a warm engine
decodes one batch of repeated-id prompts (chat prompts with --draft) three times:
- plain: wall time per step;
- under cProfile: the host's time per step, and how much of it waits for the device (the one
  blocking read a step makes); the functions with the most own time (--top);
- under the torch profiler: the device's kernel time per step, kernels per step, and the
  kernels that take most of it.
A step whose wall time is near its host time with little waiting is bound by the host; one
whose kernel time is far below its wall time while the host waits is bound by the gaps between
kernels (launch latency inside a graph): the device's idle time per step, in gaps shorter and
longer than GAP_US, tells the two apart. JSON lines go to --out.

    python benchmarks/probe_spec_overlap.py --systems none EAGLE3 --batches 1 16 64 --prob 0.7
    python benchmarks/probe_spec_overlap.py --systems EAGLE3 --draft DIR --batches 1 16
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import tempfile
import time

import common

common.add_repo_to_path()
from accept_prompts import chat_messages, repeated_id_prompts  # noqa: E402
from bench_spec_overlap import random_head  # noqa: E402
from specpcg import Engine  # noqa: E402


def steps_of(engine) -> int:
    """Decode steps so far: the target's DECODE and TARGET_VERIFY forwards (one per step of the
    whole batch; prefills not counted; a draft's forwards go to its own router)."""
    return sum(s["count"] for s in engine.get_server_info()["forward_stats"]
               if s["mode"] in ("DECODE", "TARGET_VERIFY"))


def make_engine(system: str, args, tmp: str, bs: int):
    spec = {}
    if system != "none":
        head = None if system == "NGRAM" else (args.draft or random_head(args.model_path, tmp))
        spec = dict(speculative_algorithm=system, speculative_draft_model_path=head,
                    speculative_num_steps=7, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=8,
                    speculative_simulate_accept_prob=None if args.draft else args.prob,
                    **common.PINNED_SPEC)
    return Engine(model_path=None if args.model_path == "default" else args.model_path,
                  show_progress=False, max_running_requests=bs, cuda_graph_max_bs=max(bs, 1),
                  max_total_tokens=4 * bs * (256 + args.new_tokens) + 4096,
                  skip_tokenizer_init=not args.draft, triton_verify_kernel=args.verify_kernel,
                  **spec)


def host_profile(engine, run, top: int) -> tuple:
    """(host seconds, seconds waiting on the device, the top functions by own time)."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    wait = sum(v[2] for k, v in stats.stats.items()
               if "synchronize" in k[2] or "tolist" in k[2] or "item" == k[2].split(" ")[-1])
    own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    rows = [(tottime, calls, f"{path.split('/work/')[-1].split('site-packages/')[-1]}:{line}"
             f"({func})") for (path, line, func), (_, calls, tottime, _, _) in own]
    return wall, wait, rows


GAP_US = 20  # an idle device gap at least this long waits on the host, not a graph's launch


def device_gaps(prof) -> tuple:
    """(seconds the device idled between kernels in gaps under GAP_US, in longer gaps, the
    longer gaps as (us from the first kernel, us long, the kernel after it)): the first is
    launch latency inside graphs and queues, the second waiting on the host."""
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    short, longs = 0.0, []
    end = events[0].time_range.end if events else 0
    for e in events[1:]:
        gap = e.time_range.start - end
        if gap >= GAP_US:
            longs.append((round(end - events[0].time_range.start), round(gap), e.name[:40]))
        elif gap > 0:
            short += gap
        end = max(end, e.time_range.end)
    return short / 1e6, sum(g[1] for g in longs) / 1e6, longs


def device_profile(run) -> tuple:
    """(kernel seconds, kernel launches, [(seconds, calls, name)] of the top kernels,
    device_gaps). A kernel's seconds are its own time (probe_decode_trace.own_times): one
    launched early under programmatic dependent launch waits inside its duration."""
    from torch.profiler import ProfilerActivity, profile

    from probe_decode_trace import own_times
    from probe_step_trace import cuda_kernels

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    kinds = {}
    for name, s, e in own_times(cuda_kernels(prof)):
        kind = kinds.setdefault(name[:70], [0.0, 0])
        kind[0] += (e - s) / 1e6
        kind[1] += 1
    total = sum(us for us, _ in kinds.values())
    calls = sum(n for _, n in kinds.values())
    top = sorted(((us, n, name) for name, (us, n) in kinds.items()), reverse=True)[:12]
    return total, calls, top, device_gaps(prof)


def probe(system: str, bs: int, args, tmp: str) -> dict:
    engine = make_engine(system, args, tmp, bs)
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    if args.draft:
        msgs = chat_messages(bs)
        run = lambda: engine.generate(messages=msgs, sampling_params=params)  # noqa: E731
    else:
        ids = repeated_id_prompts(bs, 128, 32, engine.model_config.vocab_size)
        run = lambda: engine.generate(input_ids=ids, sampling_params=params)  # noqa: E731
    run()  # warm-up
    row = {"bench": "step_probe", "system": system, "batch_size": bs,
           "verify_kernel": args.verify_kernel,
           "new_tokens": args.new_tokens, "prob": None if args.draft else args.prob,
           "draft": "trained" if args.draft else ("random" if system != "none" else None)}
    s0, t0 = steps_of(engine), time.perf_counter()
    run()
    common.synchronize(engine.device)
    steps = max(steps_of(engine) - s0, 1)
    row.update(steps=steps, wall_us_per_step=(time.perf_counter() - t0) / steps * 1e6,
               tok_s=bs * args.new_tokens / (time.perf_counter() - t0))
    wall, wait, host_top = host_profile(engine, run, args.top)
    row.update(profiled_us_per_step=wall / steps * 1e6, wait_us_per_step=wait / steps * 1e6,
               host_us_per_step=(wall - wait) / steps * 1e6)
    if engine.device.type == "cuda":
        kernel_s, launches, dev_top, (short, long, longs) = device_profile(run)
        row.update(kernel_us_per_step=kernel_s / steps * 1e6, kernels_per_step=launches / steps,
                   short_gaps_us_per_step=short / steps * 1e6,
                   long_gaps_us_per_step=long / steps * 1e6, long_gaps=longs,
                   top_kernels=[{"us_per_step": s / steps * 1e6, "per_step": c / steps,
                                 "name": n} for s, c, n in dev_top])
    row["top_host"] = [{"us_per_step": s / steps * 1e6, "per_step": c / steps, "func": f}
                       for s, c, f in host_top]
    engine.shutdown()
    common.free_memory(engine.device)
    return {**row, **common.machine_info(engine.device), "timestamp": common.now_iso()}


def show(row: dict) -> None:
    print(f"== {row['system']} bs={row['batch_size']}: {row['steps']} steps, "
          f"{row['tok_s']:,.0f} tok/s, wall {row['wall_us_per_step']:.0f} us/step; "
          f"profiled host {row['host_us_per_step']:.0f} + waiting {row['wait_us_per_step']:.0f} "
          f"us/step; kernels {row.get('kernel_us_per_step', 0):.0f} us/step in "
          f"{row.get('kernels_per_step', 0):.0f} launches; device idle "
          f"{row.get('short_gaps_us_per_step', 0):.0f} us/step in gaps under {GAP_US} us, "
          f"{row.get('long_gaps_us_per_step', 0):.0f} in longer", flush=True)
    for k in row.get("top_kernels", []):
        print(f"   {k['us_per_step']:8.1f} us {k['per_step']:6.1f}/step  {k['name']}")
    for h in row["top_host"]:
        print(f"   {h['us_per_step']:8.1f} us {h['per_step']:6.2f}/step  {h['func']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--systems", nargs="+", default=["none", "EAGLE3"],
                   help="none, EAGLE3, NGRAM")
    p.add_argument("--draft", default=None, help="a trained EAGLE3 head (real acceptance)")
    p.add_argument("--prob", type=float, default=0.7, help="synthetic acceptance without --draft")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--verify-kernel", default="split_k", help="triton_verify_kernel")
    p.add_argument("--stack-nodes", nargs="+", choices=("on", "off"), default=["on"],
                   help="split-K chain verify with a program taking a request's nodes (on) or "
                   "a program a node (off); both: side by side")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args(argv)
    from specpcg.attention.triton_backend import TritonAttnBackend
    from specpcg.models.loader import default_model_path

    args.model_path = args.model_path or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        for stack, system, bs in itertools.product(args.stack_nodes, args.systems, args.batches):
            TritonAttnBackend.stack_chain_nodes = stack == "on"
            row = {**probe(system, bs, args, tmp), "stack_nodes": stack}
            print(f"stack nodes {stack}:", end=" ")
            show(row)
            if args.out:
                common.append_jsonl(args.out, [row])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
