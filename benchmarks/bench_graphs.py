"""CUDA graphs against eager on one GPU: prefill TTFT, decode inter-token latency, capture cost.

Per --model-path, an "eager" (disable_cuda_graph=True) and a "graphs" engine (default: piecewise
prefill, full decode graphs) are built in turn; medians of --repeats after a warm-up. TTFT: 1 new
token, 16..4096-token prompts at batch 1 and 8 (over 4096 tokens: skipped), prefill runner from
forward_stats. ITL: of the slowest request from the batch's last first token
(common.batch_decode), batch 1..64, 32-token prompts, 128 new tokens, greedy. Also capture
time/memory, the batch-1 HBM bound, HF static cache.

    python benchmarks/bench_graphs.py                  # the default model, HF static reference too
    python benchmarks/bench_graphs.py --model-path shape:llama-3-8b   # random-weight Llama-3-8B
    python benchmarks/bench_graphs.py --quick --skip-hf --out /tmp/graphs.jsonl   # CPU smoke run
    python benchmarks/bench_graphs.py --table-only benchmarks/results/graphs.jsonl
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import time
from dataclasses import dataclass

import torch

import common
import hf_reference

common.add_repo_to_path()
import bench_engine  # noqa: E402  (HF runner, prompt windows, its measure loop)

TTFT_TARGET, BW_TARGET, HF_TARGET, BIG_MODEL = 0.35, 0.85, 5.0, "shape:llama-3-8b"
PEAK_BW = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12), ("H100 SXM", 3.35e12))  # B/s
COLORS = {"eager": "tab:blue", "graphs": "tab:orange", "hf_static": "tab:green"}


@dataclass(frozen=True)
class Settings:
    ttft_prompt_lens: tuple = (16, 64, 128, 256, 512, 1024, 2048, 4096)
    ttft_batches: tuple = (1, 8)
    decode_batches: tuple = (1, 2, 4, 8, 16, 32, 64)
    decode_prompt_len: int = 32
    new_tokens: int = 128
    max_prefill_tokens: int = 4096  # piecewise_cuda_graph_max_tokens; chunked prefill is 2x
    hf: bench_engine.Settings = bench_engine.Settings(decode_batches=(1, 8), new_tokens=128)

    def kv_tokens(self) -> int:
        decode = max(self.decode_batches) * (self.decode_prompt_len + self.new_tokens)
        prefill = [b * p for b in self.ttft_batches for p in self.ttft_prompt_lens]
        return 2 * max([decode] + [n for n in prefill if n <= self.max_prefill_tokens])


QUICK = Settings(ttft_prompt_lens=(16, 64), ttft_batches=(1, 2), decode_batches=(1, 2),
                 decode_prompt_len=16, new_tokens=8, max_prefill_tokens=64, hf=bench_engine.QUICK)


# -- measuring -------------------------------------------------------------------------------
def measure_ttft(engine, settings: Settings, stream, repeats: int, record) -> None:
    must_graph = engine.get_server_info()["piecewise_cuda_graph"]["enabled"]
    for bs, prompt_len in itertools.product(settings.ttft_batches, settings.ttft_prompt_lens):
        if bs * prompt_len > settings.max_prefill_tokens:  # over the largest piecewise graph
            record("ttft_ms", bs, prompt_len, 1, None, runner=f"skipped: {bs * prompt_len} > "
                   f"{settings.max_prefill_tokens} tokens (piecewise_cuda_graph_max_tokens)")
            continue
        ids = bench_engine.make_prompts(stream, bs, prompt_len)
        run = functools.partial(common.timed, lambda: common.generate_ids(engine, ids, 1),
                                engine.device)  # -> (metas, seconds)
        run()  # warm-up: first use of this shape
        times, runners = [], set()
        for _ in range(repeats):
            (_, seconds), used = common.served_by(engine, "EXTEND", run)
            times.append(seconds)
            runners |= used
        assert runners == {"piecewise"} or not must_graph, f"bs={bs} x {prompt_len} ran {runners}"
        record("ttft_ms", bs, prompt_len, 1, 1000 * common.median(times), runner="+".join(runners))


def measure_decode(engine, settings: Settings, stream, repeats: int, record) -> dict:
    """Records ITL and tok/s per batch size; returns {batch: itl_ms}."""
    num_new, itl_by_bs = settings.new_tokens, {}
    for bs in settings.decode_batches:
        ids = bench_engine.make_prompts(stream, bs, settings.decode_prompt_len)
        common.generate_ids(engine, ids, min(num_new, 4))  # warm-up: this batch size's shapes
        itls, runners = [], set()
        for _ in range(repeats):
            run = functools.partial(common.generate_ids, engine, ids, num_new)
            metas, used = common.served_by(engine, "DECODE", run)
            itls.append(common.batch_decode(metas)["itl_s"])
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
        return print(f"  no HBM bound: peak bandwidth of {name!r} unknown (pass --peak-bw B/s)")
    limit_tok_s, tok_s = peak / weights_bytes, 1000 / itl_bs1_ms
    record("bw_fraction", 1, None, None, tok_s / limit_tok_s, bw_limit_tok_s=limit_tok_s,
           weights_bytes=weights_bytes, peak_bw_bytes_s=peak, measured_tok_s=tok_s)


def measure_system(args, settings: Settings, graphs: bool, base: dict) -> None:
    """Builds one engine, measures it and appends its lines; fills `base` on first use."""
    from specpcg import Engine

    t0, system = time.perf_counter(), "graphs" if graphs else "eager"
    engine = Engine(model_path=args.model_path, disable_cuda_graph=not graphs, show_progress=False,
                    max_total_tokens=settings.kv_tokens(), max_running_requests=64,
                    cuda_graph_max_bs=64, chunked_prefill_size=2 * settings.max_prefill_tokens,
                    piecewise_cuda_graph_max_tokens=settings.max_prefill_tokens)
    if not base:
        base.update(common.machine_info(engine.device), dtype=str(engine.dtype)[6:])
        args.stream = torch.randint(100, min(engine.model_config.vocab_size, 32000), (16384,),
                                    generator=torch.Generator().manual_seed(0)).tolist()
        print(f"device {base['device']}, git {base['git']}, model {args.model_label}", flush=True)
    records = []

    def record(metric, bs, prompt_len, num_new, value, **extra):
        records.append({"bench": "graphs", "model": args.model_label,
                        "default_model": args.is_default, "system": system, "metric": metric,
                        "batch_size": bs, "prompt_len": prompt_len, "new_tokens": num_new,
                        "value": value, **extra, **base, "attention_backend":
                        engine.attn_backend.name, "timestamp": common.now_iso()})
        print(f"  {system:6s} {metric:17s} bs={bs} prompt={prompt_len} {common.fmt(value)} "
              f"{extra.get('runner', extra.get('graph', ''))}", flush=True)

    measure_ttft(engine, settings, args.stream, args.repeats, record)
    itl = measure_decode(engine, settings, args.stream, args.repeats, record)
    measure_static(engine, args, itl.get(1), record)
    common.append_jsonl(args.out, records)
    print(f"{system}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    engine.shutdown()  # drops model, KV cache and graphs; the shell left behind is small
    common.free_memory(engine.device)


def measure_hf(args, settings: Settings, base: dict) -> None:
    """HF static cache through bench_engine's runner and measure loop, on the same prompts."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = hf_reference.load_hf_model(args.model_path, device, getattr(torch, base["dtype"]))
    runner, records = bench_engine.HFRunner(model, device, "static"), []
    for r in bench_engine.measure(runner, settings.hf, args.stream, args.repeats, base):
        records.append({**r, "bench": "graphs", "model": args.model_label, "default_model": True})
        if r["metric"] == "decode_tok_s":
            records.append({**records[-1], "metric": "itl_ms",
                            "value": 1000 * r["batch_size"] / r["value"]})
    common.append_jsonl(args.out, records)
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
        return print("HF static: skipped (--skip-hf, or not the default model)")
    measure_hf(args, settings, base)


# -- reporting -------------------------------------------------------------------------------
def latest(records: list[dict]) -> tuple[dict, dict]:  # keys: (model, metric, bs, prompt, graph)
    return common.latest_by(records, "graphs", lambda r: (
        r["model"], r["metric"], r["batch_size"], r["prompt_len"], r.get("graph")))


def keys(t: dict, metric: str) -> list:
    """The keys of `metric`, by model, batch, prompt, graph (one type per place within a metric)."""
    return sorted((k for k in t if k[1] == metric), key=lambda k: [x or 0 for x in k])


def col(t: dict, system: str, metric=None, name: str = "value", scale: float = 1.0):
    """A column: key -> that system's `name` field of the line at key (metric swapped if given)."""
    def get(k):
        x = t.get((k[0], metric or k[1], *k[2:]), {}).get(system, {}).get(name)
        return x / scale if isinstance(x, (int, float)) and scale != 1.0 else x
    return get


def render_table(records: list[dict]) -> str:
    t = latest(records)[0]
    g, e, tok = col(t, "graphs"), col(t, "eager"), "decode_tok_s"
    part = lambda i: lambda k: k[i]  # noqa: E731
    rat = lambda a, b: lambda k: common.ratio(a(k), b(k))  # noqa: E731
    field = lambda name, scale=1.0: col(t, "graphs", None, name, scale)  # noqa: E731
    sections = [
        ("TTFT ms (batch x prompt tokens, max_new_tokens=1)", "ttft_ms", [
            ("model", part(0)), ("batch", part(2)), ("prompt", part(3)), ("eager", e),
            ("piecewise", g), ("piecewise / eager", rat(g, e)),
            ("prefill runner", field("runner")), ("HF static", col(t, "hf_static"))]),
        ("decode inter-token latency ms/step (greedy, EOS ignored)", "itl_ms", [
            ("model", part(0)), ("batch", part(2)), ("eager ITL", e), ("graph ITL", g),
            ("graph / eager", rat(g, e)), ("graph tok/s", col(t, "graphs", tok)),
            ("HF static tok/s", col(t, "hf_static", tok)),
            ("graph / HF static", rat(col(t, "graphs", tok), col(t, "hf_static", tok)))]),
        ("graph capture", "capture_time_s", [
            ("model", part(0)), ("graph", part(4)), ("capture s", g),
            ("capture MiB", col(t, "graphs", "capture_memory_mb")), ("decision", field("reason"))]),
        ("batch-1 decode vs the HBM bound (weights bytes / peak bandwidth)", "bw_fraction", [
            ("model", part(0)), ("weights GB", field("weights_bytes", 1e9)),
            ("peak TB/s", field("peak_bw_bytes_s", 1e12)), ("bound tok/s", field("bw_limit_tok_s")),
            ("graph tok/s", field("measured_tok_s")), ("graph / bound", g), ("eager / bound", e)])]
    lines = [f"\n### {title}\n{common.column_table(keys(t, metric), columns)}"
             for title, metric, columns in sections]
    return "\n".join(lines + ["\n### targets", *targets(t)]).lstrip()


def targets(t: dict) -> list[str]:
    def verdict(x, ok) -> str:
        return "not measured" if x is None else f"{common.fmt(x)} -> {'PASS' if ok(x) else 'FAIL'}"

    default = [k for k in t if any(r.get("default_model") for r in t[k].values())]
    g, e, hf = col(t, "graphs"), col(t, "eager"), col(t, "hf_static")
    lines = []
    for bs in sorted({k[2] for k in default if k[1] == "ttft_ms"}):
        ratios = [common.ratio(g(k), e(k)) for k in default if k[1] == "ttft_ms" and k[2] == bs
                  and k[3] <= 512 and col(t, "graphs", None, "runner")(k) == "piecewise"]
        worst = max((x for x in ratios if x is not None), default=None)
        lines.append(f"- default model piecewise TTFT <= {TTFT_TARGET}x eager, prompts <= 512, "
                     f"batch {bs} (worst ratio): {verdict(worst, lambda x: x <= TTFT_TARGET)}")
    bw = [g(k) for k in keys(t, "bw_fraction") if k[0] == BIG_MODEL]
    speedup = [common.ratio(g(k), hf(k)) for k in default if k[1] == "decode_tok_s" and k[2] == 1]
    return lines + [
        f"- {BIG_MODEL} batch-1 decode >= {BW_TARGET} of the HBM bound: "
        f"{verdict(bw[-1] if bw else None, lambda x: x >= BW_TARGET)}",
        f"- default model batch-1 decode tok/s >= {HF_TARGET}x HF static: "
        f"{verdict(speedup[-1] if speedup else None, lambda x: x >= HF_TARGET)}"]


def render_plots(records: list[dict], out_dir: str) -> list[str]:
    t, last = latest(records)
    panels: dict = {"ttft_ms": [], "itl_ms": []}
    for model in dict.fromkeys(k[0] for k in t):
        for metric, panel in panels.items():
            lines, styles, is_ttft = {}, {}, metric == "ttft_ms"
            for k in (k for k in keys(t, metric) if k[0] == model):
                for system, r in t[k].items():
                    name = system.replace("hf_static", "HF static") + (f" bs={k[2]}" * is_ttft)
                    lines.setdefault(name, []).append((k[3] if is_ttft else k[2], r["value"]))
                    styles[name] = {"color": COLORS[system], "marker": "os"[is_ttft and k[2] > 1],
                                    "linestyle": "--" if system == "eager" else "-"}
            panel.append({"title": f"{'TTFT' if is_ttft else 'decode ITL'}, {model}",
                          "xlabel": "prompt tokens" if is_ttft else "batch size",
                          "ylabel": "ms" if is_ttft else "ms per step", "logx": True,
                          "logy": is_ttft, "series": lines, "styles": styles})
    title = (f"eager vs CUDA graphs on {last['device']} ({last.get('dtype')}; torch "
             f"{last['torch']}, git {last.get('git')})")
    paths = [os.path.join(out_dir, "graphs_ttft.png"), os.path.join(out_dir, "graphs_itl.png")]
    for path, panel in zip(paths, panels.values()):
        common.line_plot(panel, path, title)
    return paths


def report(records: list[dict], out_path) -> None:
    print(render_table(records))
    try:  # the lines and table stand without plots; --table-only redraws them
        print("\nplots:", *render_plots(records, os.path.dirname(os.path.abspath(out_path))))
    except ImportError as exc:
        print(f"\nno plots ({exc}); pip install matplotlib, then rerun with --table-only")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir, .gguf or shape:llama-3-8b")
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
