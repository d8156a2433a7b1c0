"""A torch-profiler timeline of one piecewise prefill of 8 x 512 and of 1 x 512 tokens on the
default model (CUDA): every CPU op and GPU kernel with its start and end in microseconds from
the first event, one JSON line each, for reading where the GPU waits on the host.

    python benchmarks/probe_prefill_trace.py OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import torch

import common

common.add_repo_to_path()
import bench_engine  # noqa: E402


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from specpcg import Engine

    out = sys.argv[1]
    engine = Engine(show_progress=False, max_running_requests=64, chunked_prefill_size=8192,
                    piecewise_cuda_graph_max_tokens=4096, cuda_graph_max_bs=64)
    stream = torch.randint(100, 32000, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
    for bs, length in [(8, 512), (1, 512)]:
        ids = bench_engine.make_prompts(stream, bs, length)
        for _ in range(3):
            common.generate_ids(engine, ids, 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            common.generate_ids(engine, ids, 1)
            torch.cuda.synchronize()
        events = prof.events()
        t0 = min(ev.time_range.start for ev in events)
        with open(out, "a", encoding="utf-8") as f:
            for ev in events:
                f.write(json.dumps({"bs": bs, "L": length, "name": ev.name[:80],
                                    "dev": str(ev.device_type), "s": ev.time_range.start - t0,
                                    "e": ev.time_range.end - t0, "thread": ev.thread}) + "\n")
        print(bs, length, "events", len(events), flush=True)


if __name__ == "__main__":
    main()
