import sys, time, json, collections
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import torch, common
from specpcg import Engine
from torch.profiler import profile, ProfilerActivity

def stats(engine):
    return collections.Counter({(s["mode"], s["runner"], s["reason"]): s["count"] for s in engine.get_server_info()["forward_stats"]})

for det in (False, True):
    e = Engine(model_path="shape:llama-3-8b", enable_deterministic_inference=det, max_running_requests=64, show_progress=False)
    gen = torch.Generator().manual_seed(64)
    ids = [torch.randint(100, 20000, (128,), generator=gen).tolist() for _ in range(64)]
    common.generate_ids(e, ids[:1], 8)
    s0 = stats(e); t = time.perf_counter(); common.generate_ids(e, ids, 128); dt = time.perf_counter() - t
    print('det', det, 'tok/s', 64*128/dt, 'slots', e.get_server_info().get('max_total_num_tokens'), flush=True)
    print({k: v for k, v in (stats(e) - s0).items()}, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        common.generate_ids(e, ids, 16)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
    e.shutdown(); common.free_memory(torch.device('cuda'))
