"""CUDA graphs against eager on one GPU: prefill TTFT, decode inter-token latency, capture cost.

Per --model-path, "eager" (disable_cuda_graph=True) and "graphs" (default: piecewise prefill, full
decode graphs) engines are built in turn. Medians of --repeats after a warm-up: TTFT (generate
wall clock, 1 new token) for 16..4096-token prompts at batch 1 and 8 (points over 4096 tokens
skipped and listed) with the runner that served the prefill; decode ITL = (e2e - ttft) / (new - 1)
of the slowest request at batch 1..64 (32-token prompts, 128 new tokens, greedy, EOS ignored);
capture time/memory; the batch-1 HBM bound (weights bytes / peak B/s); HF static cache (default
model only). JSON lines to --out; a Markdown table; graphs_ttft.png and graphs_itl.png beside it.

    python benchmarks/bench_graphs.py && python benchmarks/bench_graphs.py --model-path shape:llama-3-8b
    python benchmarks/bench_graphs.py --quick --skip-hf --out /tmp/graphs.jsonl   # CPU smoke run
    python benchmarks/bench_graphs.py --table-only benchmarks/results/graphs.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
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
                 hf=bench_engine.QUICK)


# -- measuring -------------------------------------------------------------------------------
def measure_ttft(engine, settings: Settings, stream, repeats: int, record) -> None:
    must_graph = engine.get_server_info()["piecewise_cuda_graph"]["enabled"]
    for bs, prompt_len in settings.ttft_points(fits=False):  # record() prints the skip
        record("ttft_skipped", bs, prompt_len, 1, None, max_tokens=settings.max_prefill_tokens)
    for bs, prompt_len in settings.ttft_points():
        ids = bench_engine.make_prompts(stream, bs, prompt_len)
        ttft_s = lambda: common.timed(lambda: common.generate_ids(engine, ids, 1), engine.device)[1]  # noqa
        ttft_s()  # warm-up: first use of this shape
        times, runners = [], set()
        for _ in range(repeats):
            seconds, used = common.served_by(engine, "EXTEND", ttft_s)
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
        common.generate_ids(engine, ids, min(num_new, 4))  # warm-up: this batch size's shapes
        itls, runners = [], set()
        for _ in range(repeats):
            metas, used = common.served_by(engine, "DECODE", lambda: common.generate_ids(engine, ids, num_new))
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
        print(f"  {system:6s} {metric:17s} bs={bs} prompt={prompt_len} {common.fmt(value)} "
              f"{extra.get('runner', extra.get('graph', extra.get('max_tokens', '')))}", flush=True)

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


# -- reporting -------------------------------------------------------------------------------
def latest(records: list[dict]) -> tuple[dict, dict]:
    """({(model, metric, bs, prompt_len, graph): {system: line}}, last line)."""
    return common.latest_by(records, "graphs", lambda r: (
        r["model"], r["metric"], r["batch_size"], r["prompt_len"], r.get("graph")))


def keys(table: dict, metric: str) -> list:
    return sorted((k for k in table if k[1] == metric),
                  key=lambda k: (k[0], k[2] or 0, k[3] or 0, k[4] or ""))


def val(table: dict, key: tuple, system: str, field_name: str = "value"):
    return table.get(key, {}).get(system, {}).get(field_name)


def render_table(records: list[dict]) -> str:
    t = latest(records)[0]

    def col(system, metric=None, name="value", scale=1.0):
        def get(k):
            x = val(t, (k[0], metric or k[1], *k[2:]), system, name)
            return x / scale if isinstance(x, (int, float)) and scale != 1.0 else x
        return get

    def rat(a, b):
        return lambda k: common.ratio(a(k), b(k))

    def part(i):
        return lambda k: k[i]

    g, e, tok = col("graphs"), col("eager"), "decode_tok_s"
    sections = [
        ("TTFT ms (batch x prompt tokens, max_new_tokens=1)", "ttft_ms", [
            ("model", part(0)), ("batch", part(2)), ("prompt", part(3)), ("eager", e),
            ("piecewise", g), ("piecewise / eager", rat(g, e)),
            ("prefill runner", col("graphs", name="runner")), ("HF static", col("hf_static"))]),
        ("decode inter-token latency ms/step (greedy, EOS ignored)", "itl_ms", [
            ("model", part(0)), ("batch", part(2)), ("eager ITL", e), ("graph ITL", g),
            ("graph / eager", rat(g, e)), ("graph tok/s", col("graphs", tok)),
            ("HF static tok/s", col("hf_static", tok)),
            ("graph / HF static", rat(col("graphs", tok), col("hf_static", tok)))]),
        ("graph capture", "capture_time_s", [
            ("model", part(0)), ("graph", part(4)), ("capture s", g),
            ("capture MiB", col("graphs", "capture_memory_mb")),
            ("decision", col("graphs", name="reason"))]),
        ("batch-1 decode vs the HBM bound (every weight read once per token)", "bw_fraction", [
            ("model", part(0)), ("weights GB", col("graphs", name="weights_bytes", scale=1e9)),
            ("peak TB/s", col("graphs", name="peak_bw_bytes_s", scale=1e12)),
            ("bound tok/s", col("graphs", name="bw_limit_tok_s")),
            ("graph tok/s", col("graphs", name="measured_tok_s")), ("graph fraction", g),
            ("eager fraction", e)])]
    lines = []
    for title, metric, columns in sections:
        rows = [[common.fmt(x) if isinstance(x, float) or x is None else x
                 for x in (f(k) for _, f in columns)] for k in keys(t, metric)]
        lines += [f"\n### {title}", common.markdown_table([h for h, _ in columns], rows)]
    skipped = sorted({f"{k[0]} bs={k[2]} x prompt={k[3]}" for k in keys(t, "ttft_skipped")})
    lines.insert(2, "\nskipped, over piecewise_cuda_graph_max_tokens: " + (", ".join(skipped) or "none"))
    return "\n".join(lines + ["\n### targets", *targets(t)]).lstrip()


def targets(t: dict) -> list[str]:
    def verdict(value, ok) -> str:
        return "not measured" if value is None else (
            f"{common.fmt(value)} -> {'PASS' if ok(value) else 'FAIL'}")

    default = [k for k, by in t.items() if any(r.get("default_model") for r in by.values())]
    ttft = [common.ratio(val(t, k, "graphs"), val(t, k, "eager")) for k in default
            if k[1] == "ttft_ms" and k[3] <= 512 and val(t, k, "graphs", "runner") == "piecewise"]
    worst = max((x for x in ttft if x is not None), default=None)
    bw = [val(t, k, "graphs") for k in keys(t, "bw_fraction") if k[0] == BIG_MODEL]
    hf = [common.ratio(val(t, k, "graphs"), val(t, k, "hf_static")) for k in default
          if k[1] == "decode_tok_s" and k[2] == 1]
    return [f"- default model piecewise TTFT <= {TTFT_TARGET}x eager for prompts <= 512 "
            f"(worst ratio, piecewise-served points): {verdict(worst, lambda x: x <= TTFT_TARGET)}",
            f"- {BIG_MODEL} batch-1 decode >= {BW_TARGET} of the HBM bound: "
            f"{verdict(bw[-1] if bw else None, lambda x: x >= BW_TARGET)}",
            f"- default model batch-1 decode tok/s >= {HF_TARGET}x HF static: "
            f"{verdict(hf[-1] if hf else None, lambda x: x >= HF_TARGET)}"]


def render_plots(records: list[dict], out_dir: str) -> list[str]:
    t, last = latest(records)
    panels: dict = {"ttft_ms": [], "itl_ms": []}
    for model in dict.fromkeys(k[0] for k in t):
        for metric, panel in panels.items():
            lines: dict = {}
            for k in (k for k in keys(t, metric) if k[0] == model):
                for system, r in t[k].items():
                    name = NAMES[system] + (f" bs={k[2]}" if metric == "ttft_ms" else "")
                    lines.setdefault(name, []).append((k[3] if metric == "ttft_ms" else k[2],
                                                       r["value"]))
            panel.append({"title": f"{'TTFT' if metric == 'ttft_ms' else 'decode ITL'}, {model}",
                          "xlabel": "prompt tokens" if metric == "ttft_ms" else "batch size",
                          "ylabel": "ms" if metric == "ttft_ms" else "ms per step",
                          "logx": True, "logy": metric == "ttft_ms", "series": lines})
    title = (f"eager vs CUDA graphs on {last['device']} ({last.get('dtype')}; torch "
             f"{last['torch']}, git {last.get('git')})")
    paths = [os.path.join(out_dir, "graphs_ttft.png"), os.path.join(out_dir, "graphs_itl.png")]
    for path, panel in zip(paths, panels.values()):
        common.line_plot(panel, path, title)
    return paths


def report(records: list[dict], out_path) -> None:
    print(render_table(records))
    try:
        paths = render_plots(records, os.path.dirname(os.path.abspath(out_path)))
    except ImportError as exc:  # the lines and table stand without plots; --table-only redraws
        print(f"\nno plots ({exc}); pip install matplotlib, then rerun with --table-only")
        return
    print(f"\nplots: {', '.join(paths)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir, .gguf or shape:llama-3-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--peak-bw", type=float, default=None, help="HBM B/s (default: by GPU name)")
    p.add_argument("--skip-hf", action="store_true", help="no HF static reference")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "graphs.jsonl"))
    p.add_argument("--table-only", metavar="FILE", help="re-render table and plots from FILE")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.table_only:
        return report(common.read_jsonl(args.table_only), args.table_only)
    run_all(args, QUICK if args.quick else Settings())
    print(f"\nappended to {args.out}\n")
    report(common.read_jsonl(args.out), args.out)


if __name__ == "__main__":
    main()
