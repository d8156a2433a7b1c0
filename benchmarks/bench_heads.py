"""EAGLE, EAGLE3 and NEXTN heads on few-shot GSM8K: accept length, tokens/s, speedup.

Heads are the ones `drafts.train.ensure_draft` trains for the target (cached in --cache-dir;
trained on first use). Per algorithm and (steps, topk, draft tokens) setting: batch 16 over
--num-questions (accept length, tok/s) and batch 1 over --bs1-questions, piecewise graphs on;
the last chain setting of each algorithm again with piecewise graphs off. Speedups are over
no-spec at the same batch size and PCG setting, measured in the same run. Trees run on the
default attention backend like the chains (--tree-backend torch: the reference backend).

    python benchmarks/bench_heads.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_heads.py --table-only benchmarks/results/heads.jsonl
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

import common

common.add_repo_to_path()
import bench_spec  # noqa: E402
from specpcg import Engine  # noqa: E402
from specpcg.config import TRITON_VERIFY_KERNELS  # noqa: E402
from specpcg.gsm8k import STOP, build_prompts  # noqa: E402
from specpcg.models.loader import default_model_path  # noqa: E402

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
CHAINS = ((3, 1, 4), (5, 1, 6), (7, 1, 8))
TREE = (5, 4, 8)


def make_engine(args, algo, setting, pcg: bool, head: str | None, bs: int, kv_tokens: int):
    kw = dict(model_path=args.model_path, max_total_tokens=kv_tokens, max_running_requests=bs,
              cuda_graph_max_bs=bs, disable_piecewise_cuda_graph=not pcg, show_progress=False,
              triton_verify_kernel=args.triton_verify_kernel)
    if algo:
        steps, topk, tokens = setting
        kw.update(speculative_algorithm=algo, speculative_draft_model_path=head,
                  speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=tokens, **common.PINNED_SPEC)
        if topk > 1 and args.tree_backend != "auto":
            kw["attention_backend"] = args.tree_backend
    return Engine(**kw)


def measure(args, prompts, golds, algo, setting, pcg, head, bases: dict, info: dict) -> list:
    """One system at batch 16 and 1; bases[(bs, pcg)] holds no-spec's run (filled by it)."""
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "stop": STOP}
    records = []
    for bs, n in ((args.batch_size, args.num_questions), (1, args.bs1_questions)):
        engine = make_engine(args, algo, setting, pcg, head, bs, args.kv_tokens)
        engine.generate(prompt=prompts[:2], sampling_params={**params, "max_new_tokens": 8})
        name = f"{algo or 'no-spec'} {setting if algo else ''} bs{bs} PCG {'on' if pcg else 'off'}"
        bar = tqdm(total=n, unit="q", desc=name)
        run = bench_spec.run_engine(engine, prompts[:n], bs, params, bar)
        bar.close()
        rec = bench_spec.summarize(run, golds[:n], bases.get((bs, pcg)))
        if algo is None:
            bases[(bs, pcg)] = {**run, **rec}
        stats = engine.get_server_info()
        records.append({"bench": "heads", "system": algo or "nospec", "setting": list(setting)
                        if algo else None, "pcg": pcg, "batch_size": bs, **rec, **info,
                        "forward_stats": stats["forward_stats"],
                        "triton_verify_kernel": args.triton_verify_kernel,
                        "attention_backend": engine.attn_backend.name,
                        "draft_forward_stats": (engine.draft.router.forward_stats()
                                                if engine.draft is not None else None),
                        "timestamp": common.now_iso()})
        engine.shutdown()
        common.free_memory(engine.device)
    bench_spec.emit(args.out, records)
    return records


def run_all(args) -> None:
    from drafts.train import ensure_draft

    args.model_path = args.model_path or default_model_path()
    prompts, golds = build_prompts(max(args.num_questions, args.bs1_questions), args.num_shots)
    algos = args.algorithms.split(",")
    heads = {a: ensure_draft(a, target=args.model_path, cache_dir=args.cache_dir) for a in algos}
    probe = Engine(model_path=args.model_path, show_progress=False, max_total_tokens=4096)
    info = {**common.machine_info(probe.device), "dtype": str(probe.dtype).replace("torch.", ""),
            "model": args.model_path, "num_shots": args.num_shots,
            "max_new_tokens": args.max_new_tokens}
    probe.shutdown()
    bases: dict = {}
    for pcg in {"both": (True, False), "on": (True,), "off": (False,)}[args.pcg]:
        measure(args, prompts, golds, None, None, pcg, None, bases, info)
        for algo in algos:
            settings = (CHAINS if not args.tree_only else ()) + (TREE,) if pcg else CHAINS[-1:]
            if algo != "EAGLE3" and pcg:
                settings = CHAINS  # one tree setting: EAGLE3's
            for setting in settings:
                if args.settings and setting not in args.settings:
                    continue
                measure(args, prompts, golds, algo, setting, pcg, heads[algo], bases, info)


# -- reporting -------------------------------------------------------------------------------
def latest_rows(records: list[dict]) -> list[dict]:
    table, _ = common.latest_by(records, "heads", lambda r: (
        r["pcg"], r["batch_size"], tuple(r["setting"] or ())))
    keys = sorted(table, key=lambda k: (not k[0], -k[1], k[2]))
    return [table[k][s] for k in keys for s in ("nospec",) + ALGORITHMS if s in table[k]]


def render_table(records: list[dict]) -> str:
    fields = {"batch": "batch_size", "questions": "num_questions", "AL": "accept_length",
              "tok/s": "output_tok_s", "speedup": "speedup", "accuracy": "accuracy",
              "identical": "identical_frac"}
    columns = [("system", lambda r: r["system"]),
               ("(steps, topk, tokens)", lambda r: "-" if not r["setting"]
                else "({}, {}, {})".format(*r["setting"])),
               ("PCG", lambda r: "on" if r["pcg"] else "off")] + [
        (h, lambda r, f=f: r.get(f)) for h, f in fields.items()]
    # Rows of different runs can meet here; each speedup is against its own run's no-spec.
    columns.append(("commit", lambda r: r.get("git") or "-"))
    return common.column_table(latest_rows(records), columns)


def render_plot(records: list[dict], path) -> None:
    rows = [r for r in latest_rows(records) if r["pcg"] and r["setting"]]
    labels = list(dict.fromkeys("({}, {}, {})".format(*r["setting"]) for r in rows))

    def panel(title: str, field: str, bs: int) -> dict:
        by = {(r["system"], "({}, {}, {})".format(*r["setting"])): r.get(field)
              for r in rows if r["batch_size"] == bs}
        return {"title": title, "ylabel": field.replace("_", " "), "labels": labels,
                "values": {a: [by.get((a, lab)) for lab in labels] for a in ALGORITHMS}}

    last = rows[-1]
    title = (f"draft heads, GSM8K {last['num_shots']}-shot greedy, <= {last['max_new_tokens']} new "
             f"tokens, PCG on; {last['device']} ({last['dtype']}, git {last['git']})")
    common.grouped_bar_plot([panel("accept length (batch 16)", "accept_length", 16),
                             panel("speedup over no-spec, batch 1", "speedup", 1),
                             panel("speedup over no-spec, batch 16", "speedup", 16)],
                            list(ALGORITHMS), path, title)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--cache-dir", default=".cache/drafts", help="trained heads (made if missing)")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--bs1-questions", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "heads.jsonl"))
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--tree-only", action="store_true", help="PCG on: only the tree setting")
    p.add_argument("--tree-backend", default="auto", choices=("auto", "triton", "torch"),
                   help="attention backend of the tree setting")
    p.add_argument("--settings", nargs="+", type=common.parse_setting, default=None,
                   metavar="STEPS,TOPK,TOKENS", help="only these of the grid's settings")
    p.add_argument("--pcg", default="both", choices=("both", "on", "off"),
                   help="piecewise graphs on, off, or both (each with its own no-spec run)")
    p.add_argument("--triton-verify-kernel", default="split_k",
                   choices=TRITON_VERIFY_KERNELS)
    common.measure_or_render(p, argv, run_all, render_table, render_plot)


if __name__ == "__main__":
    main()
