"""CUDA graphs against eager on one GPU: prefill TTFT, decode inter-token latency, capture cost.

For one model (--model-path; default: the bundled default model) two engines are built one after
the other: "eager" = Engine(disable_cuda_graph=True) and "graphs" = Engine() (piecewise graphs
for prefill, full graphs for decode). Measured, medians of --repeats after a warm-up:
  * TTFT (max_new_tokens=1, wall clock of generate) for prompts of 16..4096 tokens at batch 1
    and 8; points whose batch x prompt exceeds piecewise_cuda_graph_max_tokens (4096) are skipped
    and listed; the runner that served each prefill is read from forward_stats.
  * decode ITL ms/step for batch 1..64 (32-token prompts, 128 new tokens, greedy, EOS ignored):
    (e2e - ttft) / (new_tokens - 1) of the slowest request; decode tok/s = batch / ITL.
  * capture time and memory of both graph kinds; the HBM bound at batch 1: weights bytes / peak
    bandwidth (H100 SXM 3.35e12 B/s, H200 4.8e12 B/s, else --peak-bw) and our fraction of it.
  * HF transformers with a static cache (bench_engine's runner) on the default model.
Prompts are random token ids (the same for every system). JSON lines go to --out; a Markdown
table is printed and graphs_ttft.png / graphs_itl.png are written next to --out.

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
import bench_engine  # noqa: E402  (HF runner, prompt windows, measure loop)

NAMES = {"eager": "eager", "graphs": "graphs", "hf_static": "HF static"}
TTFT_TARGET, BW_TARGET, HF_TARGET = 0.35, 0.85, 5.0
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

    def ttft_points(self) -> tuple[list, list]:
        """([(batch, prompt_len)] measured, [(batch, prompt_len)] skipped: over the graph max)."""
        points = [(b, p) for b in self.ttft_batches for p in self.ttft_prompt_lens]
        return ([x for x in points if x[0] * x[1] <= self.max_prefill_tokens],
                [x for x in points if x[0] * x[1] > self.max_prefill_tokens])

    def kv_tokens(self) -> int:
        decode = max(self.decode_batches) * (self.decode_prompt_len + self.new_tokens)
        return 2 * max([decode] + [b * p for b, p in self.ttft_points()[0]])


QUICK = Settings(ttft_prompt_lens=(16, 64), ttft_batches=(1, 2), decode_batches=(1, 2),
                 decode_prompt_len=16, new_tokens=8, max_prefill_tokens=64,
                 hf=bench_engine.Settings(decode_batches=(1, 2), decode_prompt_len=16,
                                          new_tokens=8, ttft_prompt_lens=(16, 32)))


# -- measuring -------------------------------------------------------------------------------
def build_engine(args, settings: Settings, graphs: bool):
    from specpcg import Engine

    return Engine(model_path=args.model_path, device=args.device, dtype=args.dtype,
                  attention_backend=args.attention_backend, disable_cuda_graph=not graphs,
                  max_total_tokens=settings.kv_tokens(), max_running_requests=64,
                  cuda_graph_max_bs=64, piecewise_cuda_graph_max_tokens=settings.max_prefill_tokens,
                  chunked_prefill_size=2 * settings.max_prefill_tokens, show_progress=False)


def generate(engine, ids, num_new: int) -> list[dict]:
    params = {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True}
    metas = [o["meta_info"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    assert all(m["completion_tokens"] == num_new for m in metas), "short output"
    return metas


def with_runners(engine, mode: str, fn):
    """(fn(), sorted runner names that served `mode` forwards during fn) from forward_stats."""
    def counts():
        return Counter({(s["mode"], s["runner"]): s["count"] for s in engine.router.forward_stats()})

    before = counts()
    result = fn()
    return result, sorted({r for (m, r), n in (counts() - before).items() if m == mode and n})


def measure_ttft(engine, settings: Settings, stream, repeats: int, record) -> None:
    must_graph = engine.get_server_info()["piecewise_cuda_graph"]["enabled"]
    measured, skipped = settings.ttft_points()
    for bs, prompt_len in skipped:
        print(f"  skip TTFT bs={bs} prompt={prompt_len}: {bs * prompt_len} tokens > "
              f"piecewise_cuda_graph_max_tokens={settings.max_prefill_tokens}")
        record("ttft_skipped", bs, prompt_len, 1, None, max_tokens=settings.max_prefill_tokens)
    for bs, prompt_len in measured:
        ids = bench_engine.make_prompts(stream, bs, prompt_len)
        ttft_s = lambda: common.timed(lambda: generate(engine, ids, 1), engine.device)[1]  # noqa
        ttft_s()  # warm-up: first use of this shape
        times, runners = [], set()
        for _ in range(repeats):
            seconds, used = with_runners(engine, "EXTEND", ttft_s)
            times.append(seconds)
            runners.update(used)
        if must_graph:
            assert runners == {"piecewise"}, f"bs={bs} prompt={prompt_len} prefill ran {runners}"
        record("ttft_ms", bs, prompt_len, 1, 1000 * common.median(times),
               runner="+".join(sorted(runners)))


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
            runners.update(used)
        itl_ms = 1000 * common.median(itls)
        itl_by_bs[bs] = itl_ms
        for metric, value in (("itl_ms", itl_ms), ("decode_tok_s", 1000 * bs / itl_ms)):
            record(metric, bs, settings.decode_prompt_len, num_new, value,
                   runner="+".join(sorted(runners)))
    return itl_by_bs


def measure_static(engine, args, itl_bs1_ms, record) -> None:
    """Capture cost of each graph kind, and the batch-1 HBM bound of the weights."""
    info = engine.get_server_info()
    for kind, key in (("piecewise", "piecewise_cuda_graph"), ("decode", "cuda_graph")):
        graph = info[key]
        for metric in ("capture_time_s", "capture_memory_mb"):
            record(metric, None, None, None, graph.get(metric), graph=kind, reason=graph["reason"])
    weights_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    name = common.device_name(engine.device)
    peak = args.peak_bw or next((bw for key, bw in PEAK_BW if key in name), None)
    if peak is None or itl_bs1_ms is None:
        print(f"  no HBM bound: peak bandwidth of {name!r} unknown (pass --peak-bw B/s)")
        return
    limit_tok_s = peak / weights_bytes
    extra = dict(weights_bytes=weights_bytes, peak_bw_bytes_s=peak, bw_limit_tok_s=limit_tok_s,
                 measured_tok_s=1000 / itl_bs1_ms)
    record("bw_limit_tok_s", 1, None, None, limit_tok_s, **extra)
    record("bw_fraction", 1, None, None, 1000 / itl_bs1_ms / limit_tok_s, **extra)


def measure_system(args, settings: Settings, graphs: bool, base: dict) -> dict:
    """Builds one engine, measures it, appends its lines; returns `base` (filled on first use)."""
    t0 = time.perf_counter()
    engine = build_engine(args, settings, graphs)
    system = "graphs" if graphs else "eager"
    if not base:
        base.update(common.machine_info(engine.device), dtype=str(engine.dtype)[6:])
        base["stream"] = bench_engine_stream(engine.model_config.vocab_size)
        print(f"device {base['device']}, torch {base['torch']}, git {base['git']}, "
              f"model {args.model_label}", flush=True)
    print(f"{system}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    records = []

    def record(metric, bs, prompt_len, num_new, value, **extra):
        records.append({"bench": "graphs", "model": args.model_label,
                        "default_model": args.is_default, "system": system, "metric": metric,
                        "batch_size": bs, "prompt_len": prompt_len, "new_tokens": num_new,
                        "value": value, **extra, **{k: v for k, v in base.items() if k != "stream"},
                        "attention_backend": engine.attn_backend.name, "timestamp": common.now_iso()})
        if value is not None:
            print(f"  {system:6s} {metric:17s} bs={bs} prompt={prompt_len} {common.fmt(value)} "
                  f"{extra.get('runner', extra.get('graph', ''))}", flush=True)

    measure_ttft(engine, settings, base["stream"], args.repeats, record)
    itl = measure_decode(engine, settings, base["stream"], args.repeats, record)
    measure_static(engine, args, itl.get(1), record)
    common.append_jsonl(args.out, records)
    print(f"{system}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    device = engine.device
    engine.shutdown()
    del engine
    common.free_memory(device)
    return base


def bench_engine_stream(vocab_size: int, num_ids: int = 16384) -> list[int]:
    """Random token ids (seeded), cut into prompt windows by bench_engine.make_prompts."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab_size, 32000), (num_ids,), generator=gen).tolist()


def measure_hf(args, settings: Settings, base: dict) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    dtype = getattr(torch, base["dtype"])
    model = common.load_hf_model(args.model_path, device, dtype)
    runner = bench_engine.HFRunner(model, device, "static")
    info = {k: v for k, v in base.items() if k != "stream"}
    records = []
    for r in bench_engine.measure(runner, settings.hf, base["stream"], args.repeats, info):
        r.update(bench="graphs", model=args.model_label, default_model=args.is_default)
        records.append(r)
        if r["metric"] == "decode_tok_s":
            records.append({**r, "metric": "itl_ms", "value": 1000 * r["batch_size"] / r["value"]})
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


# -- reporting -------------------------------------------------------------------------------
def latest(records: list[dict]) -> tuple[dict, dict]:
    """({(model, metric, bs, prompt_len, graph): {system: record}}, last line) from the latest
    line of each, among the lines measured on the same device as the file's last graphs line."""
    records = [r for r in records if r.get("bench") == "graphs"]
    if not records:
        raise ValueError("no graphs benchmark lines to render")
    table: dict = {}
    for r in records:
        if r["device"] == records[-1]["device"]:
            key = (r["model"], r["metric"], r["batch_size"], r["prompt_len"], r.get("graph"))
            table.setdefault(key, {})[r["system"]] = r
    return table, records[-1]


def rows_of(table: dict, metric: str) -> list:
    """[(model, bs, prompt_len, graph, {system: value}, {system: record})] for one metric."""
    keys = sorted((k for k in table if k[1] == metric), key=lambda k: (
        k[0], k[2] or 0, k[3] or 0, k[4] or ""))
    return [(k[0], k[2], k[3], k[4], {s: r["value"] for s, r in table[k].items()}, table[k])
            for k in keys]


def render_table(records: list[dict]) -> str:
    table, _ = latest(records)
    ttft = [[m, bs, p, *map(common.fmt, (v.get("eager"), v.get("graphs"),
                                          common.ratio(v.get("graphs"), v.get("eager")))),
             recs.get("graphs", {}).get("runner", "-"), common.fmt(v.get("hf_static"))]
            for m, bs, p, _, v, recs in rows_of(table, "ttft_ms")]
    tok_s = {(m, bs): v for m, bs, _, _, v, _ in rows_of(table, "decode_tok_s")}
    itl = [[m, bs, *map(common.fmt, (v.get("eager"), v.get("graphs"),
                                     common.ratio(v.get("graphs"), v.get("eager")),
                                     tok_s[m, bs].get("graphs"), tok_s[m, bs].get("hf_static"),
                                     common.ratio(tok_s[m, bs].get("graphs"),
                                                  tok_s[m, bs].get("hf_static"))))]
           for m, bs, _, _, v, _ in rows_of(table, "itl_ms")]
    mem = {(m, g): v.get("graphs") for m, _, _, g, v, _ in rows_of(table, "capture_memory_mb")}
    capture = [[m, g, common.fmt(v.get("graphs")), common.fmt(mem.get((m, g))),
                recs["graphs"]["reason"]] for m, _, _, g, v, recs in rows_of(table, "capture_time_s")
               if "graphs" in recs]
    bw = [[m, f"{r['weights_bytes'] / 1e9:.2f}", f"{r['peak_bw_bytes_s'] / 1e12:.2f}",
           common.fmt(r["bw_limit_tok_s"]), common.fmt(v.get("graphs") and r["bw_limit_tok_s"] *
                                                       v["graphs"]), *map(common.fmt, (
               v.get("graphs"), v.get("eager")))]
          for m, _, _, _, v, recs in rows_of(table, "bw_fraction")
          for r in [next(iter(recs.values()))]]
    skipped = [f"bs={bs} x prompt={p} ({bs * p} tokens > {recs[next(iter(recs))]['max_tokens']})"
               for m, bs, p, _, _, recs in rows_of(table, "ttft_skipped")]
    parts = [
        "### TTFT ms (batch x prompt tokens, max_new_tokens=1)",
        common.markdown_table(["model", "batch", "prompt", "eager", "piecewise", "piecewise / eager",
                               "prefill runner", "HF static"], ttft),
        f"\nskipped (over piecewise_cuda_graph_max_tokens): {', '.join(sorted(set(skipped))) or 'none'}",
        "\n### decode inter-token latency ms/step (32-token prompts, greedy, EOS ignored)",
        common.markdown_table(["model", "batch", "eager ITL", "graph ITL", "graph / eager",
                               "graph tok/s", "HF static tok/s", "graph / HF static"], itl),
        "\n### graph capture", common.markdown_table(
            ["model", "graph", "capture s", "capture MiB", "decision"], capture),
        "\n### batch-1 decode vs the HBM bound (all weights read once per token)",
        common.markdown_table(["model", "weights GB", "peak TB/s", "bound tok/s", "graph tok/s",
                               "graph fraction", "eager fraction"], bw),
        "\n### targets", *targets(table)]
    return "\n".join(parts)


def targets(table: dict) -> list[str]:
    def verdict(value, ok) -> str:
        return "not measured" if value is None else f"{common.fmt(value)} -> " + (
            "PASS" if ok(value) else "FAIL")

    default = [k for k, by in table.items() if any(r.get("default_model") for r in by.values())]
    ttft = [common.ratio(table[k].get("graphs", {}).get("value"),
                         table[k].get("eager", {}).get("value"))
            for k in default if k[1] == "ttft_ms" and k[3] <= 512]
    worst = max((x for x in ttft if x is not None), default=None)
    bw = [by["graphs"]["value"] for k, by in table.items()
          if k[0] == "shape:llama-3-8b" and k[1] == "bw_fraction" and "graphs" in by]
    speedup = [common.ratio(table[k].get("graphs", {}).get("value"),
                            table[k].get("hf_static", {}).get("value"))
               for k in default if k[1] == "decode_tok_s" and k[2] == 1]
    return [f"- default model piecewise TTFT <= {TTFT_TARGET}x eager, prompts <= 512 (worst "
            f"ratio): {verdict(worst, lambda x: x <= TTFT_TARGET)}",
            f"- 8B batch-1 decode >= {BW_TARGET} of the HBM bound: "
            f"{verdict(bw[-1] if bw else None, lambda x: x >= BW_TARGET)}",
            f"- default model batch-1 decode tok/s >= {HF_TARGET}x HF static: "
            f"{verdict(speedup[-1] if speedup else None, lambda x: x >= HF_TARGET)}"]


def render_plots(records: list[dict], out_dir: str) -> list[str]:
    table, last = latest(records)
    models = list(dict.fromkeys(k[0] for k in table))
    ttft, itl = [], []
    for model in models:
        series: dict = {}
        for m, bs, p, _, v, _ in rows_of(table, "ttft_ms"):
            for s, value in v.items():
                if m == model:
                    series.setdefault(f"{NAMES[s]} bs={bs}", []).append((p, value))
        ttft.append({"title": f"TTFT, {model}", "xlabel": "prompt tokens", "ylabel": "ms",
                     "logx": True, "logy": True, "series": series})
        series = {}
        for m, bs, _, _, v, _ in rows_of(table, "itl_ms"):
            for s, value in v.items():
                if m == model:
                    series.setdefault(NAMES[s], []).append((bs, value))
        itl.append({"title": f"decode ITL, {model}", "xlabel": "batch size",
                    "ylabel": "ms per step", "logx": True, "series": series})
    title = (f"eager vs CUDA graphs on {last['device']} ({last.get('dtype')}; torch "
             f"{last['torch']}, git {last.get('git')})")
    paths = [os.path.join(out_dir, "graphs_ttft.png"), os.path.join(out_dir, "graphs_itl.png")]
    common.line_plot(ttft, paths[0], title)
    common.line_plot(itl, paths[1], title)
    return paths


def report(records: list[dict], out_path) -> None:
    print(render_table(records))
    try:
        paths = render_plots(records, os.path.dirname(os.path.abspath(out_path)))
    except ImportError as exc:  # the lines and table stand without plots; --table-only redraws
        print(f"\nno plots ({exc}); pip install matplotlib, then rerun with --table-only")
        return
    print(f"\nplots: {', '.join(paths)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir, .gguf or shape:llama-3-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--peak-bw", type=float, default=None, help="HBM bytes/s (default by name)")
    p.add_argument("--skip-hf", action="store_true", help="no HF static reference")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "graphs.jsonl"))
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the table and plots from an existing JSON-lines file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_only:
        report(common.read_jsonl(args.table_only), args.table_only)
        return
    run_all(args, QUICK if args.quick else Settings())
    print(f"\nappended to {args.out}\n")
    report(common.read_jsonl(args.out), args.out)


if __name__ == "__main__":
    main()
