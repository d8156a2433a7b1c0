"""Torch-profiler timeline of one bs8 x 512 prefill (graphs engine): CPU ops and GPU kernels with
start/end (us from the first event), written as JSON lines for local analysis."""
import sys, json
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import torch, common, bench_engine
from torch.profiler import profile, ProfilerActivity
from specpcg import Engine
out = sys.argv[1]
e = Engine(disable_cuda_graph=False, show_progress=False, max_running_requests=64, chunked_prefill_size=8192, piecewise_cuda_graph_max_tokens=4096, cuda_graph_max_bs=64)
stream = torch.randint(100, 32000, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
for bs, L in [(8, 512), (1, 512)]:
    ids = bench_engine.make_prompts(stream, bs, L)
    for _ in range(3): common.generate_ids(e, ids, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        common.generate_ids(e, ids, 1); torch.cuda.synchronize()
    evs = prof.events()
    t0 = min(ev.time_range.start for ev in evs)
    with open(out, 'a') as f:
        for ev in evs:
            f.write(json.dumps({"bs": bs, "L": L, "name": ev.name[:80], "dev": str(ev.device_type), "s": ev.time_range.start - t0, "e": ev.time_range.end - t0, "thread": ev.thread}) + "\n")
    print(bs, L, 'events', len(evs), flush=True)
