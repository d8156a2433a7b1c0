"""CUDA graphs against eager on one GPU: prefill TTFT, decode inter-token latency, capture cost.

Two engines are built one after the other for --model-path: "eager" (disable_cuda_graph=True) and
"graphs" (the default: piecewise graphs for prefill, full graphs for decode). Medians of --repeats
after a warm-up: TTFT (generate wall clock, max_new_tokens=1) for 16..4096-token prompts at batch
1 and 8, skipping points over piecewise_cuda_graph_max_tokens (4096) and naming the runner that
served each prefill (forward_stats); decode ITL = (e2e - ttft) / (new - 1) of the slowest request
for batch 1..64 (32-token prompts, 128 new tokens, greedy, EOS ignored), tok/s = batch / ITL;
capture time and memory of both graph kinds; the batch-1 HBM bound (weights bytes / peak
bandwidth: H100 SXM 3.35e12, H200 4.8e12 B/s, else --peak-bw); HF transformers with a static
cache (bench_engine's runner) on the default model. Prompts: seeded random ids, the same for all.
JSON lines go to --out; a Markdown table is printed, graphs_ttft.png and graphs_itl.png are saved.

    python benchmarks/bench_graphs.py && python benchmarks/bench_graphs.py --model-path shape:llama-3-8b
    python benchmarks/bench_graphs.py --quick --skip-hf --out /tmp/graphs.jsonl   # CPU smoke run
    python benchmarks/bench_graphs.py --table-only benchmarks/results/graphs.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

import common

common.add_repo_to_path()
import bench_engine  # noqa: E402  (HF runner, prompt windows, its measure loop)

NAMES = {"eager": "eager", "graphs": "graphs", "hf_static": "HF static"}
TTFT_TARGET, BW_TARGET, HF_TARGET, BIG_MODEL = 0.35, 0.85, 5.0, "shape:llama-3-8b"
PEAK_BW = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12), ("H100 SXM", 3.35e12))


@dataclass(frozen=True)
class Settings:
    ttft_prompt_lens: tuple = (16, 64, 128, 256, 512, 1024, 2048, 4096)
    ttft_batches: tuple = (1, 8)
    decode_batches: tuple = (1, 2, 4, 8, 16, 32, 64)
    decode_prompt_len: int = 32
    new_tokens: int = 128
    max_prefill_tokens: int = 4096  # piecewise_cuda_graph_max_tokens; chunked prefill is 2x
    hf: bench_engine.Settings = field(default_factory=lambda: bench_engine.Settings(
        decode_batches=(1, 8), new_tokens=128, ttft_prompt_lens=(128, 512, 2048)))

    def ttft_points(self, fits: bool = True) -> list:
        """[(batch, prompt_len)] within the graph's max tokens (fits) or over it (not fits)."""
        return [(b, p) for b in self.ttft_batches for p in self.ttft_prompt_lens
                if (b * p <= self.max_prefill_tokens) == fits]

    def kv_tokens(self) -> int:
        decode = max(self.decode_batches) * (self.decode_prompt_len + self.new_tokens)
        return 2 * max([decode] + [b * p for b, p in self.ttft_points()])


QUICK = Settings(ttft_prompt_lens=(16, 64), ttft_batches=(1, 2), decode_batches=(1, 2),
                 decode_prompt_len=16, new_tokens=8, max_prefill_tokens=64,
                 hf=bench_engine.Settings(decode_batches=(1, 2), decode_prompt_len=16,
                                          new_tokens=8, ttft_prompt_lens=(16, 32)))


# -- measuring -------------------------------------------------------------------------------
def generate(engine, ids, num_new: int) -> list[dict]:
    params = {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True}
    metas = [o["meta_info"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    assert all(m["completion_tokens"] == num_new for m in metas), "short output"
    return metas


def with_runners(engine, mode: str, fn) -> tuple:
    """(fn(), set of runners that served `mode` forwards during fn), read from forward_stats."""
    def counts():
        return Counter({(s["mode"], s["runner"]): s["count"] for s in engine.router.forward_stats()})

    before = counts()
    result = fn()
    return result, {r for (m, r), n in (counts() - before).items() if m == mode and n}


def measure_ttft(engine, settings: Settings, stream, repeats: int, record) -> None:
    must_graph = engine.get_server_info()["piecewise_cuda_graph"]["enabled"]
    for bs, prompt_len in settings.ttft_points(fits=False):
        print(f"  skip TTFT bs={bs} prompt={prompt_len}: {bs * prompt_len} tokens > "
              f"piecewise_cuda_graph_max_tokens={settings.max_prefill_tokens}")
        record("ttft_skipped", bs, prompt_len, 1, None, max_tokens=settings.max_prefill_tokens)
    for bs, prompt_len in settings.ttft_points():
        ids = bench_engine.make_prompts(stream, bs, prompt_len)
        ttft_s = lambda: common.timed(lambda: generate(engine, ids, 1), engine.device)[1]  # noqa
        ttft_s()  # warm-up: first use of this shape
        times, runners = [], set()
        for _ in range(repeats):
            seconds, used = with_runners(engine, "EXTEND", ttft_s)
            times.append(seconds)
            runners |= used
        if must_graph:
            assert runners == {"piecewise"}, f"bs={bs} prompt={prompt_len} prefill ran {runners}"
        record("ttft_ms", bs, prompt_len, 1, 1000 * common.median(times), runner="+".join(runners))


def measure_decode(engine, settings: Settings, stream, repeats: int, record) -> dict:
    """Records ITL and tok/s per batch size; returns {batch: itl_ms}."""
    num_new, itl_by_bs = settings.new_tokens, {}
    for bs in settings.decode_batches:
        ids = bench_engine.make_prompts(stream, bs, settings.decode_prompt_len)
        generate(engine, ids, min(num_new, 4))  # warm-up: this batch size's shapes
        itls, runners = [], set()
        for _ in range(repeats):
            metas, used = with_runners(engine, "DECODE", lambda: generate(engine, ids, num_new))
            slowest = max(metas, key=lambda m: m["e2e_latency"])
            itls.append((slowest["e2e_latency"] - slowest["ttft"]) / (num_new - 1))
            runners |= used
        itl_by_bs[bs] = itl_ms = 1000 * common.median(itls)
        for metric, value in (("itl_ms", itl_ms), ("decode_tok_s", 1000 * bs / itl_ms)):
            record(metric, bs, settings.decode_prompt_len, num_new, value, runner="+".join(runners))
    return itl_by_bs


def measure_static(engine, args, itl_bs1_ms, record) -> None:
    """Capture cost of each graph kind, and the batch-1 HBM bound of the weights."""
    info = engine.get_server_info()
    for kind, key in (("piecewise", "piecewise_cuda_graph"), ("decode", "cuda_graph")):
        for metric in ("capture_time_s", "capture_memory_mb"):
            record(metric, None, None, None, info[key].get(metric), graph=kind,
                   reason=info[key]["reason"])
    weights_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    name = common.device_name(engine.device)
    peak = args.peak_bw or next((bw for key, bw in PEAK_BW if key in name), None)
    if peak is None or itl_bs1_ms is None:
        print(f"  no HBM bound: peak bandwidth of {name!r} unknown (pass --peak-bw B/s)")
        return
    limit_tok_s, tok_s = peak / weights_bytes, 1000 / itl_bs1_ms
    extra = dict(weights_bytes=weights_bytes, peak_bw_bytes_s=peak, measured_tok_s=tok_s)
    record("bw_limit_tok_s", 1, None, None, limit_tok_s, **extra)
    record("bw_fraction", 1, None, None, tok_s / limit_tok_s, bw_limit_tok_s=limit_tok_s, **extra)


def measure_system(args, settings: Settings, graphs: bool, base: dict) -> None:
    """Builds one engine, measures it and appends its lines; fills `base` on first use."""
    from specpcg import Engine

    t0, system = time.perf_counter(), "graphs" if graphs else "eager"
    engine = Engine(model_path=args.model_path, device=args.device, disable_cuda_graph=not graphs,
                    max_total_tokens=settings.kv_tokens(), max_running_requests=64,
                    cuda_graph_max_bs=64, chunked_prefill_size=2 * settings.max_prefill_tokens,
                    piecewise_cuda_graph_max_tokens=settings.max_prefill_tokens, show_progress=False)
    if not base:
        base.update(common.machine_info(engine.device), dtype=str(engine.dtype)[6:])
        gen = torch.Generator().manual_seed(0)  # prompts: seeded random ids below 32000
        args.stream = torch.randint(100, min(engine.model_config.vocab_size, 32000), (16384,),
                                    generator=gen).tolist()
        print(f"device {base['device']}, torch {base['torch']}, git {base['git']}, "
              f"model {args.model_label}", flush=True)
    print(f"{system}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    records = []

    def record(metric, bs, prompt_len, num_new, value, **extra):
        records.append({"bench": "graphs", "model": args.model_label,
                        "default_model": args.is_default, "system": system, "metric": metric,
                        "batch_size": bs, "prompt_len": prompt_len, "new_tokens": num_new,
                        "value": value, **extra, **base, "attention_backend":
                        engine.attn_backend.name, "timestamp": common.now_iso()})
        if value is not None:
            print(f"  {system:6s} {metric:17s} bs={bs} prompt={prompt_len} {common.fmt(value)} "
                  f"{extra.get('runner', extra.get('graph', ''))}", flush=True)

    measure_ttft(engine, settings, args.stream, args.repeats, record)
    itl = measure_decode(engine, settings, args.stream, args.repeats, record)
    measure_static(engine, args, itl.get(1), record)
    common.append_jsonl(args.out, records)
    print(f"{system}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    device = engine.device
    engine.shutdown()
    del engine
    common.free_memory(device)


def measure_hf(args, settings: Settings, base: dict) -> None:
    """HF static cache through bench_engine's runner and measure loop, on the same prompts."""
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    model = common.load_hf_model(args.model_path, device, getattr(torch, base["dtype"]))
    runner, records = bench_engine.HFRunner(model, device, "static"), []
    for r in bench_engine.measure(runner, settings.hf, args.stream, args.repeats, base):
        records.append({**r, "bench": "graphs", "model": args.model_label, "default_model": True})
        if r["metric"] == "decode_tok_s":
            records.append({**records[-1], "metric": "itl_ms",
                            "value": 1000 * r["batch_size"] / r["value"]})
    common.append_jsonl(args.out, records)
    runner.close()
    del model, runner
    common.free_memory(device)


def run_all(args, settings: Settings) -> None:
    from specpcg.models.build import SHAPE_PREFIX
    from specpcg.models.loader import default_model_path

    is_shape = bool(args.model_path) and args.model_path.startswith(SHAPE_PREFIX)
    default = None if is_shape else default_model_path()
    args.model_path = args.model_path or default
    args.is_default = not is_shape and os.path.abspath(args.model_path) == os.path.abspath(default)
    args.model_label = args.model_path if is_shape else os.path.basename(args.model_path)
    base: dict = {}
    for graphs in (False, True):
        measure_system(args, settings, graphs, base)
    if args.skip_hf or not args.is_default:
        print("HF static: skipped (" + ("--skip-hf" if args.skip_hf else "default model only") + ")")
        return
    t0 = time.perf_counter()
    measure_hf(args, settings, base)
    print(f"HF static: done in {time.perf_counter() - t0:.1f} s", flush=True)
