"""Overlapped speculative steps against synchronous ones, side by side in one run.

Per model and batch size: no-spec decode, then the same draft with overlap scheduling on (the
default) and off (`disable_overlap_schedule`), at each acceptance:

- synthetic (`--probs`, speculative_simulate_accept_prob: NOT lossless, benchmark only): an
  EAGLE3 head with random weights, whose drafts are accepted with probability p; on the default
  model and the Llama-3-8B shape (random weights). Framework efficiency = speedup / accept length
  (1.0: verifying costs one decode step and drafting is free).
- real (`--draft DIR`, greedy, lossless): a trained head on held-out chat first turns; outputs
  of both modes are compared token for token.
- `--algorithm NGRAM`: NGRAM's chain instead of a head, synthetic (`--probs`) or real (`--probs`
  with no values: chat first turns), its overlapped steps matching on the device.

Decode tok/s = batch / ITL of the slowest request from the batch's last first token
(common.batch_decode), median of --repeats (as bench_accept part B).

    python benchmarks/bench_spec_overlap.py                          # synthetic, both models
    python benchmarks/bench_spec_overlap.py --draft DIR --probs      # a trained head, chat
    python benchmarks/bench_spec_overlap.py --algorithm NGRAM --probs  # NGRAM, chat
    python benchmarks/bench_spec_overlap.py --table-only benchmarks/results/spec_overlap.jsonl
"""

from __future__ import annotations

import argparse
import os
import tempfile

import common

common.add_repo_to_path()
from accept_prompts import chat_messages, repeated_id_prompts  # noqa: E402
from bench_accept import BIG_MODEL, close, spec_counts, stage  # noqa: E402
from specpcg import Engine  # noqa: E402
from specpcg.config import EngineConfig  # noqa: E402
from specpcg.models.loader import default_model_path  # noqa: E402

MODES = (("no-spec", None), ("sync", True), ("overlap", False))  # name, disable_overlap_schedule


def random_head(target: str, tmp: str) -> str:
    import torch

    from drafts.head_checkpoint import random_head as make, save_head

    cfg = common.model_config(target)
    head, spec = make("EAGLE3", cfg, "cpu", torch.float32, draft_vocab_size=8192)
    return save_head(head, spec, cfg, os.path.join(tmp, "random-eagle3"))


def draft_label(head, chat: bool) -> str:
    if head is None:
        return "NGRAM"
    return os.path.basename(head.rstrip("/")) if chat else "random EAGLE3"


def measure(engine, inputs: list, params: dict, repeats: int, chat: bool) -> dict:
    """Decode tok/s (batch / slowest request's ITL, median), accept length, outputs."""
    run = (lambda: engine.generate(messages=inputs, sampling_params=params)) if chat else \
        (lambda: engine.generate(input_ids=inputs, sampling_params=params))
    run()  # warm-up of this batch size
    emitted0, verify0, _ = spec_counts(engine)
    rates, outs = [], None
    for _ in range(repeats):
        outs = run()
        metas = [o["meta_info"] for o in outs]
        rates.append(len(inputs) / common.batch_decode(metas)["itl_s"])
    emitted1, verify1, _ = spec_counts(engine)
    return {"decode_tok_s": common.median(rates),
            "accept_length": common.ratio(emitted1 - emitted0, verify1 - verify0) or 1.0,
            "outputs": [o["output_ids"] for o in outs]}


def run_model(args, label: str, target: str, head: str, prob, info: dict) -> list:
    most = max(args.batches)
    chat = prob is None
    params = {"max_new_tokens": args.new_tokens, "temperature": 0,
              "ignore_eos": not chat}
    base = dict(device=args.device, show_progress=False, model_path=target,
                max_total_tokens=2 * most * (600 + args.new_tokens) + 2048,
                max_running_requests=most, cuda_graph_max_bs=most, skip_tokenizer_init=not chat,
                **common.PINNED_SPEC)
    spec = dict(speculative_algorithm=args.algorithm, speculative_draft_model_path=head,
                speculative_num_steps=7, speculative_eagle_topk=1,
                speculative_num_draft_tokens=8, speculative_simulate_accept_prob=prob)
    results: dict = {}
    for mode, disable in MODES:
        engine = Engine(**base, **({} if disable is None else spec),
                        disable_overlap_schedule=bool(disable))
        inputs = chat_messages(most) if chat else repeated_id_prompts(
            most, 128, 32, engine.model_config.vocab_size)
        for bs in args.batches:
            results[(mode, bs)] = measure(engine, inputs[:bs], params, args.repeats, chat)
        close(engine)
    records = []
    for bs in args.batches:
        plain = results[("no-spec", bs)]["decode_tok_s"]
        row = {"bench": "spec_overlap", "model": label, "acceptance": "real" if chat else "synthetic",
               "prob": prob, "algorithm": args.algorithm, "draft": draft_label(head, chat),
               "setting": [7, 1, 8], "batch_size": bs, "new_tokens": args.new_tokens,
               "repeats": args.repeats, "nospec_tok_s": plain}
        for mode in ("sync", "overlap"):
            r = results[(mode, bs)]
            speedup = common.ratio(r["decode_tok_s"], plain)
            row[mode] = {"decode_tok_s": r["decode_tok_s"], "accept_length": r["accept_length"],
                         "speedup": speedup, "efficiency": common.ratio(speedup, r["accept_length"])}
        row["overlap_over_sync"] = common.ratio(row["overlap"]["decode_tok_s"],
                                                row["sync"]["decode_tok_s"])
        if chat:
            row["identical_outputs"] = sum(a == b for a, b in zip(
                results[("sync", bs)]["outputs"], results[("overlap", bs)]["outputs"]))
            row["num_prompts"] = bs
        records.append({**row, **info, "timestamp": common.now_iso()})
        print(f"  {label} p={prob} bs={bs}: no-spec {common.fmt(plain)}; sync "
              f"{common.fmt(row['sync']['speedup'])}x, overlap {common.fmt(row['overlap']['speedup'])}x"
              f" (AL {common.fmt(row['overlap']['accept_length'])}), overlap/sync "
              f"{common.fmt(row['overlap_over_sync'])}", flush=True)
    return records


def run_all(args) -> None:
    model = args.model_path or default_model_path()
    cfg = EngineConfig(device=args.device)
    device = cfg.resolve_device()
    dtype = cfg.resolve_dtype(device)
    info = {**common.machine_info(device), "dtype": str(dtype).replace("torch.", "")}
    print(f"device {info['device']}, git {info['git']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_spec_overlap_") as tmp:
        target = stage(model, dtype, tmp)
        models = [(os.path.basename(model), target)]
        if not args.skip_8b and not args.draft:
            models.append((BIG_MODEL, BIG_MODEL))
        for label, path in models:
            head = None if args.algorithm == "NGRAM" else args.draft or random_head(path, tmp)
            for prob in (args.probs or [None]):
                common.append_jsonl(args.out, run_model(args, label, path, head, prob, info))


def render_table(records: list) -> str:
    rows = list({(r["model"], r.get("algorithm", "EAGLE3"), r["prob"], r["batch_size"]): r
                 for r in records if r.get("bench") == "spec_overlap"}.values())
    return common.column_table(rows, [
        ("model", lambda r: r["model"]), ("algorithm", lambda r: r.get("algorithm", "EAGLE3")),
        ("p", lambda r: "real" if r["prob"] is None else r["prob"]),
        ("batch", lambda r: r["batch_size"]), ("no-spec tok/s", lambda r: r["nospec_tok_s"]),
        ("AL", lambda r: r["overlap"]["accept_length"]),
        ("sync speedup", lambda r: r["sync"]["speedup"]),
        ("overlap speedup", lambda r: r["overlap"]["speedup"]),
        ("sync eff.", lambda r: r["sync"]["efficiency"]),
        ("overlap eff.", lambda r: r["overlap"]["efficiency"]),
        ("overlap / sync", lambda r: r["overlap_over_sync"])])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--draft", default=None, help="a trained EAGLE3 head: real acceptance, chat")
    p.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE3", "NGRAM"])
    p.add_argument("--probs", nargs="*", type=float, default=[0.7, 0.95],
                   help="synthetic acceptance (empty with --draft: real)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--new-tokens", type=int, default=129)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "spec_overlap.jsonl"))
    p.add_argument("--table-only", metavar="FILE", default=None)
    args = p.parse_args(argv)
    if args.table_only:
        print(render_table(common.read_jsonl(args.table_only)))
        return
    run_all(args)
    print(render_table(common.read_jsonl(args.out)))


if __name__ == "__main__":
    main()
