"""The cost of enable_deterministic_inference: decode throughput in that mode against the default
mode, in one run, at batch 1, 16 and 64, no-spec and speculative, on the default model and the
8B shape (random weights).

Speculative: EAGLE3 (7,1,8) on the default model, with --draft DIR or else the cached default
draft (trained first on a miss: about ten minutes on one H100); on the 8B shape, which has no
trained draft, --big-spec EAGLE3 (a random head) or NGRAM, with synthetic acceptance
(speculative_simulate_accept_prob, a benchmark-only mode); lines without an `algorithm` field
ran NGRAM there. Prompts: held-out chat first turns on a model with a tokenizer (--prompts
chat, the default; it needs `pip install 'specpcg[train]'` for the chat data), random ids of
--prompt-len otherwise (the 8B shape; lines without a `prompts` field took them everywhere);
--new-tokens each, ignore_eos; tok/s = batch * new tokens / wall time of the generate call
(median of --repeats). Each line also has both modes' accept lengths and the cost per step at
equal acceptance (the two modes' greedy tokens differ, and a draft accepts them differently).
The two modes' engines live side by side and their timed runs alternate, so both share one
history:
with one engine after the other, the default engine of the 8B shape once decoded batch 64 at
4,191 tok/s after batches 1 and 16 and at 7,166 fresh (probe_modes.py).

    python benchmarks/bench_deterministic.py [--batches 1 16 64] [--skip-8b | --skip-default]
                                             [--repeats 3] [--draft DIR] [--prompts random]
                                             [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import common

common.add_repo_to_path()

BIG = "shape:llama-3-8b"


def spec_kwargs(model: str, spec: bool, args, tmp: str) -> dict:
    """The engine options of a cell (one call per cell: an 8B-shaped head is 1.3 GB, in tmp)."""
    if not spec:
        return {}
    if model == BIG:
        head = None
        if args.big_spec == "EAGLE3":  # the cell: overlapped steps, like a real head's
            from bench_spec_overlap import random_head

            head = random_head(BIG, tmp)
        return dict(speculative_algorithm=args.big_spec, speculative_draft_model_path=head,
                    speculative_simulate_accept_prob=args.accept, speculative_num_steps=7,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=8,
                    **common.PINNED_SPEC)  # the whole chain (no chain depth per batch size)
    if args.draft is None:
        from drafts.train import ensure_draft

        print("[bench_deterministic] no --draft: the default EAGLE3 draft (trained first if it "
              "is not cached)", flush=True)
        args.draft = ensure_draft("EAGLE3")
    return dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft,
                speculative_num_steps=7, speculative_eagle_topk=1,
        speculative_num_draft_tokens=8, **common.PINNED_SPEC)


CHAT_PROMPT_TOKENS = 4  # x --prompt-len: the longest chat prompt taken


def _prompts(batch: int, args, tokenizer) -> list:
    """Held-out chat first turns (--prompts chat, a model with a tokenizer), else random ids."""
    import torch

    if args.prompts == "chat" and tokenizer is not None:
        from drafts.data import heldout_samples
        from drafts.distill import first_prompts

        return first_prompts(heldout_samples("sharegpt", 4 * batch), tokenizer, batch,
                             CHAT_PROMPT_TOKENS * args.prompt_len)
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)]


def measure_pair(engines: dict, batch: int, args) -> tuple:
    """({deterministic: tok/s}, {deterministic: accept length}): the two engines' timed runs
    interleaved (default, deterministic, default, ...), so both see the same history and the
    same drift of the machine. The accept length (tokens per request per verify; None without
    speculation) tells a slower mode from one whose greedy tokens a draft predicts less well:
    the modes' tokens differ (the default mode's depend on the batch), and so do their drafts'
    acceptance."""
    ids = _prompts(batch, args, engines[False].tokenizer)
    for engine in engines.values():
        common.generate_ids(engine, ids[:1], 8)  # warm-up
    times = {det: [] for det in engines}
    accept = {}
    for _ in range(args.repeats):
        for det, engine in engines.items():
            t0 = time.perf_counter()
            metas = common.generate_ids(engine, ids, args.new_tokens)
            times[det].append(time.perf_counter() - t0)
            verifies = sum(m.get("spec_verify_ct", 0) for m in metas)
            accept[det] = len(ids) * args.new_tokens / verifies if verifies else None
    return ({det: len(ids) * args.new_tokens / common.median(t) for det, t in times.items()},
            accept)


def step_cost(rate: dict, accept: dict) -> float:
    """The mode's cost per step: its throughput cost at equal accept lengths."""
    if accept[False] is None or accept[True] is None:
        return 1 - rate[True] / rate[False]
    return 1 - (rate[True] / accept[True]) / (rate[False] / accept[False])


def run(args) -> list:
    from specpcg import Engine

    models = ([] if args.skip_default else [args.model_path]) + ([] if args.skip_8b else [BIG])
    # Both engines live at once: a KV cache sized to the largest batch (outputs, a spec step's
    # overshoot and a margin) instead of the default share of the GPU's memory.
    lines = []
    for model in models:
        longest = args.prompt_len * (CHAT_PROMPT_TOKENS if model != BIG else 1)
        kv_tokens = 2 * max(args.batches) * (longest + args.new_tokens + 16)
        for spec in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                kw = spec_kwargs(model, spec, args, tmp)
                engines = {det: Engine(model_path=model, enable_deterministic_inference=det,
                                       max_running_requests=max(args.batches),
                                       show_progress=False, max_total_tokens=kv_tokens, **kw)
                           for det in (False, True)}
            rates = {b: measure_pair(engines, b, args) for b in args.batches}
            device = engines[False].device
            for engine in engines.values():
                engine.shutdown()
            for b in args.batches:
                (rate, accept), chat = rates[b], args.prompts == "chat" and model != BIG
                lines.append({"bench": "deterministic_cost", "model": model or "default",
                              "spec": spec, "batch": b, "default_tok_s": rate[False],
                              "algorithm": kw.get("speculative_algorithm"),
                              "deterministic_tok_s": rate[True],
                              "cost": 1 - rate[True] / rate[False],
                              "default_accept_length": accept[False],
                              "deterministic_accept_length": accept[True],
                              "step_cost": step_cost(rate, accept),
                              "prompts": "chat" if chat else "random",
                              "repeats": args.repeats, "interleaved": True,
                              **common.machine_info(device)})
                print(f"[bench_deterministic] {model or 'default'} spec={spec} bs={b}: "
                      f"cost {lines[-1]['cost']:.1%} (per step {lines[-1]['step_cost']:.1%})",
                      flush=True)
            common.append_jsonl(args.out, lines[-len(args.batches):])  # kept if a later cell dies
    return lines


def _latest(records: list) -> list:
    """The lines of the latest run (its git) in the file."""
    records = [r for r in records if r.get("bench") == "deterministic_cost"]
    return [r for r in records if r.get("git") == records[-1].get("git")] if records else []


def _cell(r: dict) -> str:
    return f"{'8B shape' if r['model'] == BIG else r['model']} {'spec' if r['spec'] else 'no-spec'}"


def _accepts(r: dict) -> str:
    a, b = r.get("default_accept_length"), r.get("deterministic_accept_length")
    return f"{a:.2f} / {b:.2f}" if a and b else ""


def render_table(records: list) -> str:
    rows = [[_cell(r), str(r["batch"]), r.get("prompts", "random"), common.fmt(r["default_tok_s"]),
             common.fmt(r["deterministic_tok_s"]), f"{r['cost']:.1%}", _accepts(r),
             f"{r['step_cost']:.1%}" if "step_cost" in r else "", r.get("git", "")]
            for r in _latest(records)]
    return common.markdown_table(["model", "batch", "prompts", "default tok/s",
                                  "deterministic tok/s", "cost", "accept length (default / "
                                  "deterministic)", "cost per step", "git"], rows)


def render_plot(records: list, path) -> None:
    latest = _latest(records)
    cells = sorted({_cell(r) for r in latest})
    batches = sorted({r["batch"] for r in latest})
    cost = {(_cell(r), r["batch"]): 100 * r["cost"] for r in latest}
    panel = {"title": f"cost of the deterministic mode ({latest[-1].get('git', '')})",
             "ylabel": "% throughput lost (goal <= 15 at bs 16, 64)",
             "labels": [f"bs {b}" for b in batches],
             "values": {c: [cost.get((c, b)) for b in batches] for c in cells}}
    common.grouped_bar_plot([panel], cells, path, "enable_deterministic_inference vs default")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prompts", choices=("chat", "random"), default="chat",
                   help="chat: held-out chat first turns (up to 4x --prompt-len tokens) where "
                        "the model has a tokenizer; the 8B shape always takes random ids")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--accept", type=float, default=0.7, help="8B shape: simulated acceptance")
    p.add_argument("--big-spec", choices=("EAGLE3", "NGRAM"), default="EAGLE3",
                   help="the 8B shape's speculative cells (synthetic acceptance)")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--skip-default", action="store_true", help="the 8B shape's cells only")
    p.add_argument("--draft", default=None, metavar="DIR", help="the default model's EAGLE3 draft")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "deterministic_cost.jsonl"))
    p.add_argument("--table-only", action="store_true", help="table and plot of --out only")
    args = p.parse_args(argv)
    if not args.table_only:
        run(args)
    common.render_results(args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
