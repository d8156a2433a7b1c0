"""Trained drafts on three held-out prompt sets: accept length, its histogram, and batch-1 and
batch-16 speedup over no-spec, for every draft and NGRAM at each (steps, topk, tokens).

Prompt sets (none of them trained on; drafts.data holds them out): `gsm8k-fewshot` (the
benchmark's 5-shot format, test split), `gsm8k` (zero-shot through the chat template, test
split), `chat` (ShareGPT first turns held out of training). One engine per (draft, setting)
serves every set: batch 1 runs --bs1-prompts prompts one after another, batch 16 runs
--num-prompts at once (max_running_requests 16). Greedy, --max-new-tokens, EOS ends a request.
Speedup = tok/s over the no-spec engine's in the same run; `identical` counts outputs equal to
no-spec's. Every step speculates unless --adaptive (the engine's default: per batch size, the
faster of speculative and plain steps); the accept length counts speculative steps only.

    python benchmarks/bench_drafts.py --drafts EAGLE3=DIR EAGLE=DIR ... [--out FILE]
    python benchmarks/bench_drafts.py --table-only benchmarks/results/drafts.jsonl
"""

from __future__ import annotations

import argparse
import time

import common

common.add_repo_to_path()

SETS = {"gsm8k-fewshot": "gsm8k-fewshot", "gsm8k": "gsm8k", "chat": "sharegpt"}
CHAIN_ONLY = ("STANDALONE",)


def prompt_sets(tokenizer, num: int, names=tuple(SETS)) -> dict:
    from drafts.data import heldout_samples
    from drafts.distill import first_prompts

    return {name: first_prompts(heldout_samples(SETS[name], 4 * num), tokenizer, num)
            for name in names}


def run(engine, prompts: list, params: dict) -> tuple:
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return outs, time.perf_counter() - t0


def measure(engine, prompts: list, bs1_prompts: int, params: dict) -> dict:
    run(engine, prompts[:1], {**params, "max_new_tokens": 8})  # warm-up
    one_s, one_tokens = 0.0, 0
    for p in prompts[:bs1_prompts]:
        outs, dt = run(engine, [p], params)
        one_s, one_tokens = one_s + dt, one_tokens + outs[0]["meta_info"]["completion_tokens"]
    outs, dt = run(engine, prompts, params)
    metas = [o["meta_info"] for o in outs]
    verifies = sum(m.get("spec_verify_ct", 0) for m in metas)
    tokens = sum(m["completion_tokens"] for m in metas)
    spec_tokens = tokens - sum(m.get("plain_decode_tokens", 0) for m in metas)
    hist = None
    if verifies:
        hist = [sum(c) for c in zip(*(m["spec_accept_histogram"] for m in metas))]
    return {"bs1_tok_s": one_tokens / one_s, "bs16_tok_s": tokens / dt,
            "accept_length": spec_tokens / verifies if verifies else None,
            "accept_histogram": hist,
            "output_ids": [o["output_ids"] for o in outs]}


def systems(drafts: dict, settings: list, ngram: bool = True) -> list:
    out = [("no-spec", None, None, None)]
    for algo in ["NGRAM"] * ngram + list(drafts):
        for s in settings:
            if s[1] > 1 and algo in CHAIN_ONLY:
                continue
            out.append((f"{algo} {s[0]},{s[1]},{s[2]}", algo, drafts.get(algo), s))
    return out


def run_all(args) -> None:
    from specpcg import Engine

    drafts = dict(item.split("=", 1) for item in args.drafts)
    settings = [common.parse_setting(s) for s in args.settings]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    sets, reference, base = None, {}, {}
    for system, algo, path, s in systems(drafts, settings, not args.no_ngram):
        kw = {} if algo is None else dict(
            speculative_algorithm=algo, speculative_draft_model_path=path,
            speculative_num_steps=s[0], speculative_eagle_topk=s[1],
            speculative_num_draft_tokens=s[2], disable_adaptive_speculation=not args.adaptive)
        if args.adaptive and algo is not None:
            system += " adaptive"
        try:
            engine = Engine(model_path=args.model_path, max_running_requests=args.num_prompts,
                            show_progress=False, **kw)
        except Exception as exc:  # noqa: BLE001 - one failed setting must not end the run
            if algo is None:
                raise  # no baseline, no speedups
            print(f"[bench_drafts] {system}: the engine failed to start: {exc!r}", flush=True)
            common.append_jsonl(args.out, [{"bench": "drafts_error", "system": system,
                                            "error": repr(exc)}])
            continue
        sets = sets or prompt_sets(engine.tokenizer, args.num_prompts, args.sets)
        lines = []
        for name, prompts in sets.items():
            m = measure(engine, prompts, args.bs1_prompts, params)
            ids = m.pop("output_ids")
            if algo is None:
                reference[name], base[name] = ids, m
            lines.append({
                "bench": "drafts", "system": system, "algorithm": algo or "none",
                "setting": list(s) if s else None, "prompt_set": name,
                "adaptive": bool(args.adaptive and algo),
                "num_prompts": len(prompts), "bs1_prompts": args.bs1_prompts,
                "max_new_tokens": args.max_new_tokens, **m,
                "speedup_bs1": m["bs1_tok_s"] / base[name]["bs1_tok_s"],
                "speedup_bs16": m["bs16_tok_s"] / base[name]["bs16_tok_s"],
                "identical": sum(a == b for a, b in zip(ids, reference[name])),
                "draft": path, **common.machine_info(engine.device)})
            print(f"[bench_drafts] {system:18} {name:14} AL {common.fmt(m['accept_length'])} "
                  f"bs1 {lines[-1]['speedup_bs1']:.2f}x bs16 {lines[-1]['speedup_bs16']:.2f}x "
                  f"identical {lines[-1]['identical']}/{len(prompts)}", flush=True)
        engine.shutdown()
        common.append_jsonl(args.out, lines)


def render_table(records: list) -> str:
    table, last = common.latest_by(records, "drafts", lambda r: (r["prompt_set"],))
    systems_seen = list(dict.fromkeys(r["system"] for r in records if r.get("bench") == "drafts"))
    cols = [("system", lambda k: k)]
    for name in SETS:
        row = table.get((name,), {})
        cols += [(f"{name} AL", lambda k, row=row: (row.get(k) or {}).get("accept_length")),
                 (f"bs1", lambda k, row=row: (row.get(k) or {}).get("speedup_bs1")),
                 (f"bs16", lambda k, row=row: (row.get(k) or {}).get("speedup_bs16"))]
    # Each system's row is its latest line: runs of several commits can share the table.
    cols.append(("commit", lambda k: next((row[k].get("git") for row in table.values()
                                           if k in row), None)))
    return (f"{last['device']}: accept length and speedup over no-spec (the latest run of "
            f"each system)\n\n" + common.column_table(systems_seen, cols))


def render_plot(records: list, png) -> None:
    table, last = common.latest_by(records, "drafts", lambda r: (r["prompt_set"],))
    names = list(dict.fromkeys(r["system"] for r in records
                               if r.get("bench") == "drafts" and r["algorithm"] != "none"))
    panels = []
    for metric, label in (("accept_length", "accept length"), ("speedup_bs1", "bs 1 speedup"),
                          ("speedup_bs16", "bs 16 speedup")):
        panels.append({"title": label, "ylabel": label, "labels": list(SETS), "values": {
            n: [(table.get((s,), {}).get(n) or {}).get(metric) for s in SETS] for n in names}})
    common.grouped_bar_plot(panels, names, png, f"held-out prompt sets, {last['device']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--drafts", nargs="*", default=[], metavar="ALGO=DIR")
    p.add_argument("--settings", nargs="+", default=["3,1,4", "7,1,8", "5,4,8"])
    p.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS),
                   help="prompt sets to run (default: all three)")
    p.add_argument("--no-ngram", action="store_true", help="skip NGRAM (a sweep of one draft)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--bs1-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "drafts.jsonl"))
    p.add_argument("--table-only", metavar="FILE", default=None)
    p.add_argument("--adaptive", action="store_true",
                   help="the engine's adaptive speculation (default: every step speculative)")
    a = p.parse_args(argv)
    if not a.table_only:
        run_all(a)
    common.render_results(a.table_only or a.out, render_table, render_plot)


if __name__ == "__main__":
    main()
