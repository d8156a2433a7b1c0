"""One fresh engine per mode (default, then deterministic) at one batch size: decode throughput,
which runner served each forward, and the top CUDA kernels of a short generate (torch profiler).

bench_deterministic measures every batch size on one engine per mode; this probe asks whether a
cell there is the mode's cost or the engine's history.

    python benchmarks/probe_modes.py [--model-path shape:llama-3-8b] [--batch 64] [--spec]
                                     [--draft DIR]
                                     [--history 1 16]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import common

common.add_repo_to_path()


def _stats(engine) -> collections.Counter:
    return collections.Counter({(s["mode"], s["runner"], s["reason"]): s["count"]
                                for s in engine.get_server_info()["forward_stats"]})


def probe(model: str, batch: int, deterministic: bool, args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from specpcg import Engine

    spec = {} if not args.spec else dict(  # as bench_deterministic's spec cells
        speculative_algorithm="NGRAM", speculative_simulate_accept_prob=0.7,
        speculative_num_steps=7, speculative_num_draft_tokens=8, **common.PINNED_SPEC)
    if args.draft:
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft,
                    speculative_num_steps=7, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=8, **common.PINNED_SPEC)
    engine = Engine(model_path=None if model == "default" else model, enable_deterministic_inference=deterministic,
                    max_running_requests=batch, show_progress=False, **spec)
    gen = torch.Generator().manual_seed(batch)
    ids = [torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()
           for _ in range(batch)]
    common.generate_ids(engine, ids[:1], 8)  # warm-up
    for b in args.history:  # batches run first, as bench_deterministic's one engine ran them
        t0 = time.perf_counter()
        common.generate_ids(engine, [ids[i % batch] for i in range(b)], args.new_tokens)
        print(f"  history batch {b}: {b * args.new_tokens / (time.perf_counter() - t0):,.0f} "
              f"tok/s", flush=True)
    before, t0 = _stats(engine), time.perf_counter()
    common.generate_ids(engine, ids, args.new_tokens)
    seconds = time.perf_counter() - t0
    print(f"deterministic={deterministic} batch={batch}: "
          f"{batch * args.new_tokens / seconds:,.0f} tok/s", flush=True)
    print(dict(_stats(engine) - before), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        common.generate_ids(engine, ids, 16)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
    engine.shutdown()
    common.free_memory(torch.device("cuda"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="shape:llama-3-8b", help="'default': the default model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--history", type=int, nargs="*", default=[],
                   help="batch sizes to run on the engine before the probed one")
    p.add_argument("--spec", action="store_true",
                   help="NGRAM (7, 1, 8) with simulated acceptance 0.7 (benchmark-only mode)")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="EAGLE3 (7, 1, 8) with this head instead, pinned (bench_deterministic's "
                        "default-model spec cells)")
    args = p.parse_args()
    for deterministic in (False, True):
        probe(args.model_path, args.batch, deterministic, args)


if __name__ == "__main__":
    main()
