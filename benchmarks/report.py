"""The performance report: every benchmark's latest table, from its JSON lines, in one Markdown
file (benchmarks/results/REPORT.md), each with the command that produced it and the machine.

    python benchmarks/report.py            # tables from what benchmarks/results/ holds
    python benchmarks/report.py --readme README.md   # also the README's headline table
    bash scripts/report.sh                 # on a GPU: run every benchmark, then this

A benchmark whose results file is missing is listed as not measured, never filled in.
"""

from __future__ import annotations

import argparse
import importlib
import json

import common
import headline

RESULTS = common.RESULTS_DIR
# (title, results file, module with render_table / render_tables, command that makes the file)
SECTIONS = [
    ("Engine vs Hugging Face transformers", "engine.jsonl", "bench_engine",
     "python benchmarks/bench_engine.py --model-path MODEL"),
    ("CUDA graphs: eager vs piecewise prefill, eager vs graph decode", "graphs.jsonl",
     "bench_graphs", "python benchmarks/bench_graphs.py --model-path MODEL (and shape:llama-3-8b)"),
    ("Decode against a compiled static-cache peer (gpt-fast style)", "reference.jsonl",
     "bench_reference", "python benchmarks/bench_reference.py [--skip-8b | --only-8b]"),
    ("Speculative decoding: NGRAM, STANDALONE and HF references", "spec.jsonl", "bench_spec",
     "python benchmarks/bench_spec.py --model-path MODEL"),
    ("EAGLE-family heads", "heads.jsonl", "bench_heads",
     "python benchmarks/bench_heads.py --model-path MODEL"),
    ("Accept length and framework efficiency", "accept.jsonl", "bench_accept",
     "python benchmarks/bench_accept.py --model-path MODEL"),
    ("EAGLE-family heads at batch 1 with the draft round graphs", "round_bs1.jsonl", None,
     "the inline loop in README.md (EAGLE-family heads section)"),
    ("Where a batch-1 step's time goes", "step.jsonl", None,
     "python benchmarks/bench_step.py --model-path MODEL --algorithms none,EAGLE,EAGLE3,NEXTN"),
    ("GSM8K matrix", "gsm8k_matrix.jsonl", None,
     "python -m pytest -m cuda tests/test_gsm8k_matrix.py "
     "tests/test_gsm8k_matrix_deterministic.py"),
    ("NGRAM proposal cost", "ngram.jsonl", None, "python benchmarks/bench_ngram.py"),
    ("Trained drafts on held-out prompt sets", "drafts.jsonl", "bench_drafts",
     "python benchmarks/bench_drafts.py --drafts EAGLE3=DIR --settings 7,1,8 3,1,4"),
    ("Adaptive speculation vs pinned, against no-spec", "adaptive.jsonl", "bench_adaptive",
     "python benchmarks/bench_adaptive.py [--model-path shape:llama-3-8b] [--drafts ALGO=DIR]"),
    ("Adaptive speculation on simulated batches (CPU)", "sim_adaptive.jsonl", "sim_adaptive",
     "python benchmarks/sim_adaptive.py"),
    ("Deterministic inference: its throughput cost", "deterministic_cost.jsonl", "bench_deterministic",
     "python benchmarks/bench_deterministic.py --batches 1 16 64"),
    ("The batch-invariant matmul against cuBLAS", "matmul.jsonl", "bench_matmul",
     "python benchmarks/bench_matmul.py"),
    ("The draft trainer's step", "train_step.jsonl", None,
     "python benchmarks/bench_train_step.py"),
    ("The draft trainer's self-distillation, by step kind", "probe_distill.jsonl", None,
     "python benchmarks/probe_distill.py --num-prompts 4000 [--engine-kw JSON]"),
]
# The first five name a cell (plain_table): the mode, and a tree's spec_settings, set it apart.
MATRIX_FIELDS = ("algorithm", "deterministic", "pcg", "attention_backend", "spec_settings",
                 "num_questions", "accuracy", "baseline_accuracy", "identical_frac",
                 "max_near_tie_ulps", "avg_accept_length", "piecewise_hits")
ROUND_FIELDS = ("system", "setting", "batch_size", "num_questions", "accept_length",
                "output_tokens", "seconds", "output_tok_s", "speedup")
STEP_FIELDS = ("system", "setting", "random_heads", "triton_verify_kernel", "step_us",
               "tokens_per_step", "graph_gpu_us", "phases_us")
DETERMINISTIC_FIELDS = ("model", "spec", "batch", "git", "default_tok_s", "deterministic_tok_s",
                        "cost")
TRAIN_STEP_FIELDS = ("variant", "device", "git", "steps", "ms_per_step", "tokens_per_s",
                     "ttt_window", "prompt_share")
DISTILL_FIELDS = ("engine_kw", "git", "sequences", "answer_tokens", "wall_s", "answer_tok_s",
                  "prefill_steps", "prefill_s", "decode_steps", "decode_s")
NGRAM_FIELDS = ("batch_size", "context", "topk", "num_draft_tokens", "first_propose_ms",
                "steady_propose_ms")


def plain_table(records: list[dict], keys: tuple, identity: int = 4) -> str:
    """The latest line per combination of the first `identity` keys (those not measured)."""
    latest = {}
    for r in records:
        latest[tuple(str(r.get(k)) for k in keys[:identity])] = r  # str: settings are lists
    return common.column_table(list(latest.values()), [(k, lambda r, k=k: r.get(k)) for k in keys])


def machine_line(records: list[dict]) -> str:
    last = records[-1]
    return ", ".join(f"{k} {last[k]}" for k in ("device", "torch", "dtype", "git") if last.get(k))


def section(title: str, file: str, module: str | None, command: str) -> str:
    path = RESULTS / file
    head = f"## {title}\n\nCommand: `{command}` (results `benchmarks/results/{file}`)\n\n"
    if not path.exists():
        return head + "Not measured yet.\n"
    records = common.read_jsonl(path)
    if module is None:
        keys = {"gsm8k_matrix.jsonl": MATRIX_FIELDS, "round_bs1.jsonl": ROUND_FIELDS,
                "step.jsonl": STEP_FIELDS, "deterministic_cost.jsonl": DETERMINISTIC_FIELDS,
                "train_step.jsonl": TRAIN_STEP_FIELDS,
                "probe_distill.jsonl": DISTILL_FIELDS}.get(file, NGRAM_FIELDS)
        table = plain_table(records, keys, 5 if keys is MATRIX_FIELDS else 4)
    else:
        bench = importlib.import_module(module)
        render = getattr(bench, "render_table", None) or getattr(bench, "render_tables")
        table = render(records)
    return head + f"Machine: {machine_line(records)}\n\n{table}\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "REPORT.md"))
    p.add_argument("--readme", default=None,
                   help="also rewrite this file's headline table (between its report markers)")
    args = p.parse_args(argv)
    common.add_repo_to_path()
    parts = ["# specpcg performance report\n\nGenerated by `python benchmarks/report.py` from "
             "the JSON lines in benchmarks/results/; every figure was measured.\n"]
    parts += [section(*s) for s in SECTIONS]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    print(f"wrote {args.out}")
    if args.readme:
        headline.write_readme(args.readme, RESULTS)
        print(f"wrote the headline table of {args.readme}")
    print(json.dumps({s[1]: (RESULTS / s[1]).exists() for s in SECTIONS}))


if __name__ == "__main__":
    main()
