"""One model across tensor / pipeline layouts (tp x pp), graphs on and off: decode throughput,
TTFT, greedy identity with one GPU, speculative framework efficiency, and what each rank's
start-up cost (graph capture time and memory, GPU memory held).

Each (layout, piecewise graphs on/off) runs in a process of its own (a parallel engine owns its
process group) and builds one engine per system there, one after another:
- "no-spec": decode of --batches greedy requests (--prompt-len random ids, --max-new-tokens,
  EOS ignored; median of --repeats after a warm-up), and TTFT of one request of each
  --ttft-lens prompt length (one new token);
- each --spec algorithm (NGRAM; EAGLE3 with a random head made once, the same for every
  layout), speculating on every step (adaptive speculation off), 3 draft steps: the same
  decode batches, greedy, so their tokens are compared too;
- each --synthetic P: NGRAM with speculative_simulate_accept_prob = P (NOT lossless): its accept
  length and framework efficiency (speedup over no-spec / accept length).
Each decode batch keeps a hash of every request's tokens; the table compares them with the
latest tp 1 x pp 1 no-spec line of the same graph setting ("identical": the share of requests
whose tokens all match), so layouts measured in separate runs compare too.

    python benchmarks/bench_layouts.py --model-path shape:llama-3-8b --layouts 1x1 2x1 4x1 1x2 2x2
    python benchmarks/bench_layouts.py --table-only benchmarks/results/layouts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import common

WORKER = "--worker"


# -- in the worker process ---------------------------------------------------------------------
def _decode(engine, ids: list, new: int, repeats: int) -> dict:
    import torch

    device = torch.device(engine.device)
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params=params)  # warm-up of this batch size
    runs = []
    for _ in range(repeats):
        outs, sec = common.timed(lambda: engine.generate(input_ids=ids, sampling_params=params),
                                 device)
        metas = [o["meta_info"] for o in outs]
        itl = common.batch_decode(metas)["itl_s"]
        verify = sum(m.get("spec_verify_ct", 0) for m in metas)
        runs.append({"e2e_tok_s": len(ids) * new / sec, "decode_tok_s": len(ids) / itl,
                     "accept_length": common.ratio(sum(m["completion_tokens"] - m.get(
                         "plain_decode_tokens", 0) for m in metas), verify) or 1.0,
                     "outputs": [o["output_ids"] for o in outs]})
    best = {k: common.median(r[k] for r in runs) for k in ("e2e_tok_s", "decode_tok_s",
                                                            "accept_length")}
    return {**best, "output_sha": [common.output_digest(ids) for ids in runs[-1]["outputs"]]}


def _ttft_ms(engine, ids: list, repeats: int) -> float:
    import torch

    device = torch.device(engine.device)
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=[ids], sampling_params=params)
    times = [common.timed(lambda: engine.generate(input_ids=[ids], sampling_params=params),
                          device)[1] for _ in range(repeats)]
    return 1e3 * common.median(times)


def _ranks(engine) -> list:
    from specpcg.distributed.worker import rank_report

    ranks = engine.get_server_info()["ranks"]
    return ranks or [rank_report(engine.config, 0, engine.graphs, engine.device)]


def measure(spec: dict) -> list:
    """[point] of every system at one layout and graph setting (see the docstring)."""
    import random

    from specpcg import Engine

    tp, pp = spec["layout"]
    rng = random.Random(0)
    low, high = min(100, spec["vocab"] // 4), min(30000, spec["vocab"])
    token = lambda: rng.randrange(low, high)  # noqa: E731
    prompts = [[token() for _ in range(spec["prompt_len"])] for _ in range(max(spec["batches"]))]
    longest = max(spec["ttft_lens"] + [spec["prompt_len"] + spec["new"]])
    base = dict(model_path=spec["model_path"], tp_size=tp, pp_size=pp, dtype=spec["dtype"],
                skip_tokenizer_init=True, show_progress=False,
                max_running_requests=max(spec["batches"]),
                cuda_graph_max_bs=max(spec["batches"]),
                max_total_tokens=2 * max(spec["batches"]) * (spec["prompt_len"] + spec["new"]
                                                             + 16) + 2 * longest,
                disable_piecewise_cuda_graph=not spec["pcg"])
    out = []
    for system in spec["systems"]:
        t0 = time.perf_counter()
        engine = Engine(**base, **system["kw"])
        out.append({"system": system["name"], "metric": "startup",
                    "value": time.perf_counter() - t0, "ranks": _ranks(engine)})
        try:
            for bs in spec["batches"]:
                point = _decode(engine, prompts[:bs], spec["new"], spec["repeats"])
                out.append({"system": system["name"], "metric": "decode", "batch": bs, **point})
            if system["name"] == "no-spec":
                for n in spec["ttft_lens"]:
                    ids = [token() for _ in range(n)]
                    out.append({"system": "no-spec", "metric": "ttft", "prompt_len": n,
                                "value": _ttft_ms(engine, ids, spec["repeats"])})
        finally:
            engine.shutdown()
        print(f"  {system['name']}: done", flush=True)
    return out


# -- the driver ----------------------------------------------------------------------------------
def systems(args, head_dir) -> list:
    out = [{"name": "no-spec", "kw": {}}]
    for algo in args.spec:
        kw = {"speculative_algorithm": algo, "speculative_num_steps": 3,
              "disable_adaptive_speculation": True}
        if algo == "EAGLE3":
            kw["speculative_draft_model_path"] = head_dir
        out.append({"name": algo, "kw": kw})
    for p in args.synthetic:
        out.append({"name": f"NGRAM p={p}", "kw": {
            "speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
            "speculative_simulate_accept_prob": p, "disable_adaptive_speculation": True}})
    return out


def random_eagle3_head(cfg, dtype: str, out_dir: str) -> str:
    import torch

    from drafts.head_checkpoint import random_head, save_head

    head, spec = random_head("EAGLE3", cfg, "cpu", torch.float32,
                             draft_vocab_size=min(8192, cfg.vocab_size))
    return save_head(head.to(getattr(torch, dtype)), spec, cfg, out_dir)


def lines_of(points: list, layout: tuple, pcg: bool, args, info: dict) -> list:
    """JSON lines of one worker's points; each speculative decode line gets its efficiency
    against this layout's no-spec decode rate (measured first, in the same process)."""
    lines, nospec = [], {}
    for pt in points:
        line = {"bench": "layouts", **info, "time": common.now_iso(), "model": args.model_path,
                "dtype": args.dtype, "layout": f"tp{layout[0]}pp{layout[1]}", "tp": layout[0],
                "pp": layout[1], "pcg": pcg, "prompt_len": args.prompt_len,
                "new_tokens": args.max_new_tokens, **pt}
        if pt["metric"] == "decode":
            if pt["system"] == "no-spec":
                nospec[pt["batch"]] = pt["decode_tok_s"]
            speedup = common.ratio(pt["decode_tok_s"], nospec.get(pt["batch"]))
            line.update(speedup=speedup, efficiency=common.ratio(speedup, pt["accept_length"]))
        lines.append(line)
    return lines


def run_all(args) -> None:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = common.machine_info(device)
    layouts = [tuple(int(x) for x in text.split("x")) for text in args.layouts]
    with tempfile.TemporaryDirectory(prefix="bench_layouts_") as tmp:
        cfg = common.model_config(args.model_path)
        head = random_eagle3_head(cfg, args.dtype, tmp) if "EAGLE3" in args.spec else None
        for pcg in (setting == "on" for setting in args.pcg):
            for layout in layouts:
                print(f"tp x pp = {layout}, piecewise graphs {'on' if pcg else 'off'}",
                      flush=True)
                spec = {"layout": layout, "pcg": pcg, "model_path": args.model_path,
                        "vocab": cfg.vocab_size,
                        "dtype": args.dtype, "batches": args.batches, "ttft_lens": args.ttft_lens,
                        "prompt_len": args.prompt_len, "new": args.max_new_tokens,
                        "repeats": args.repeats, "systems": systems(args, head)}
                points = common.run_json_worker(__file__, WORKER, spec)
                common.append_jsonl(args.out, lines_of(points, layout, pcg, args, info))


# -- rendering -------------------------------------------------------------------------------------
def _latest(records: list) -> list:
    rows = [r for r in records if r.get("bench") == "layouts"]
    if not rows:
        raise ValueError("no layouts benchmark lines to render")
    last = rows[-1]
    return [r for r in rows if (r["device"], r["model"]) == (last["device"], last["model"])]


def identical(line: dict, rows: list):
    """The share of `line`'s requests whose tokens equal the latest tp 1 x pp 1 no-spec line's
    of its graph setting and batch (None for synthetic acceptance, or with no such line)."""
    if line["system"].startswith("NGRAM p="):
        return None
    refs = [r for r in rows if r["metric"] == "decode" and r["system"] == "no-spec"
            and (r["tp"], r["pp"], r["pcg"], r["batch"]) == (1, 1, line["pcg"], line["batch"])
            and (r["prompt_len"], r["new_tokens"]) == (line["prompt_len"], line["new_tokens"])]
    if not refs:
        return None
    ref = refs[-1]["output_sha"]
    return sum(a == b for a, b in zip(line["output_sha"], ref)) / len(ref)


def _key(r) -> str:
    return f"{r['layout']} {'pcg' if r['pcg'] else 'no pcg'}"


def render_table(records: list) -> str:
    rows = _latest(records)
    decode = [r for r in rows if r["metric"] == "decode"]
    batches = sorted({r["batch"] for r in decode})
    cell = {(_key(r), r["system"], r["batch"]): r for r in decode}
    keys = list(dict.fromkeys((_key(r), r["system"]) for r in decode))
    cols = [("layout", lambda k: k[0]), ("system", lambda k: k[1])]
    for b in batches:
        cols += [(f"bs {b} tok/s", lambda k, b=b: cell.get((*k, b), {}).get("decode_tok_s")),
                 (f"bs {b} identical", lambda k, b=b: _same(cell.get((*k, b)), rows)),
                 (f"bs {b} AL / eff.", lambda k, b=b: _al_eff(cell.get((*k, b))))]
    out = [f"{rows[-1]['model']} ({rows[-1]['dtype']}) on {rows[-1]['device']}\n",
           common.column_table(keys, cols)]
    ttft = {(_key(r), r["prompt_len"]): r["value"] for r in rows if r["metric"] == "ttft"}
    lens = sorted({n for _, n in ttft})
    tkeys = list(dict.fromkeys(k for k, _ in ttft))
    out += ["\nTTFT ms (one request)\n", common.column_table(
        tkeys, [("layout", lambda k: k)] + [(f"{n} tokens", lambda k, n=n: ttft.get((k, n)))
                                            for n in lens])]
    starts = [r for r in rows if r["metric"] == "startup" and r["system"] == "no-spec"]
    ranks = [(_key(r), rank) for r in starts for rank in r["ranks"]]
    out += ["\nStart-up per rank (no-spec engine)\n", common.column_table(ranks, [
        ("layout", lambda k: k[0]), ("rank", lambda k: k[1]["rank"]),
        ("stage", lambda k: k[1]["stage"]),
        ("pcg capture s", lambda k: _cap(k[1], "piecewise_cuda_graph", "capture_time_s")),
        ("pcg MiB", lambda k: _cap(k[1], "piecewise_cuda_graph", "capture_memory_mb")),
        ("decode graphs s", lambda k: _cap(k[1], "cuda_graph", "capture_time_s")),
        ("stage graphs s", lambda k: _cap(k[1], "pipeline_stage_graphs", "capture_time_s")),
        ("GPU MiB held", lambda k: k[1].get("memory_allocated_mb")),
        ("GPU MiB peak", lambda k: k[1].get("max_memory_allocated_mb"))])]
    return "\n".join(out)


def _same(line, rows):
    return None if line is None else identical(line, rows)


def _al_eff(r) -> str:
    if r is None or r["system"] == "no-spec":
        return "-"
    return f"{common.fmt(r['accept_length'])} / {common.fmt(r.get('efficiency'))}"


def _cap(rank: dict, graph: str, key: str):
    value = rank.get(graph, {}).get(key)
    return float(value) if value is not None else None


def render_plot(records: list, png) -> None:
    rows = _latest(records)
    decode = [r for r in rows if r["metric"] == "decode" and r["system"] == "no-spec"]
    ttft = [r for r in rows if r["metric"] == "ttft"]
    series = lambda rs, x, y: {k: [(r[x], r[y]) for r in rs if _key(r) == k]  # noqa: E731
                               for k in dict.fromkeys(_key(r) for r in rs)}
    common.line_plot([
        {"title": "no-spec decode throughput", "xlabel": "batch size", "ylabel": "output tok/s",
         "logx": True, "logy": True, "series": series(decode, "batch", "decode_tok_s")},
        {"title": "TTFT, one request", "xlabel": "prompt tokens", "ylabel": "ms", "logx": True,
         "logy": True, "series": series(ttft, "prompt_len", "value")}],
        png, f"bench_layouts: {rows[-1]['model']} ({rows[-1]['dtype']}) on {rows[-1]['device']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="shape:llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"],
                   help="TPxPP, e.g. 1x1 2x1 4x1 1x2 2x2 (identity needs a 1x1 line)")
    p.add_argument("--pcg", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--spec", nargs="*", default=["NGRAM", "EAGLE3"], choices=["NGRAM", "EAGLE3"])
    p.add_argument("--synthetic", type=float, nargs="*", default=[0.7])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ttft-lens", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "layouts.jsonl"))
    common.measure_or_render(p, argv, run_all, render_table, render_plot)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == WORKER:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared hosts)
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
