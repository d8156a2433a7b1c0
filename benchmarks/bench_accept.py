"""Accept length per draft and setting (part A), framework efficiency at any accept length (B).

Part A (real drafts, greedy): per algorithm (NGRAM; EAGLE, EAGLE3, NEXTN, STANDALONE drafts by
`drafts.train.ensure_draft`, cached in --cache-dir) and (steps, topk, draft tokens), the
--num-prompts of each set at once (batch --a-batch): few-shot GSM8K, and 40 chat prompts (chat
template). Accept length (engine; mean over requests), accepted-drafts histogram (requests'
summed, and the engine's), tok/s. Trees use --attention-backend like the chains.

Part B (synthetic acceptance, speculative_simulate_accept_prob = p: NOT lossless, benchmark
only): an NGRAM chain of --b-steps steps, p in --b-probs, batch --b-batches, on the default
model and shape:llama-3-8b (random weights; not with --skip-8b), random-id prompts of one
repeated segment, ignore_eos. Decode tok/s = batch / ITL of the slowest request from the batch's
last first token (common.batch_decode), median of --repeats; speedup = spec / no-spec;
framework efficiency = no-spec's decode step time / the verify step's, both at the whole batch
(1 = verifying N tokens costs one decode step and drafting is free; no-spec runs first and
last, and the faster pass is the baseline: `part_b`); efficiency_mean_al =
speedup / accept length, the accept length being (completion tokens - 1) / verify steps.

    python benchmarks/bench_accept.py                      # A and B, default model + 8B shape
    python benchmarks/bench_accept.py --parts B --b-batches 1 16 --skip-8b
    python benchmarks/bench_accept.py --quick --out /tmp/accept.jsonl   # CPU smoke run
    python benchmarks/bench_accept.py --table-only benchmarks/results/accept.jsonl
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, replace

import torch

import common

common.add_repo_to_path()
from accept_prompts import chat_messages, repeated_id_prompts  # noqa: E402
from accept_report import ALGORITHMS, plot_compare, render_plots, render_tables  # noqa: E402
from specpcg import Engine  # noqa: E402
from specpcg.config import EngineConfig  # noqa: E402
from specpcg.gsm8k import STOP, build_prompts  # noqa: E402
from specpcg.models.loader import default_model_path, load_checkpoint  # noqa: E402
from specpcg.tokenizer import load_tokenizer  # noqa: E402

CHAINS = ((1, 1, 2), (2, 1, 3), (3, 1, 4), (5, 1, 6), (7, 1, 8))
TREES = ((3, 2, 6), (5, 4, 8))
BIG_MODEL = "shape:llama-3-8b"


@dataclass(frozen=True)
class Settings:
    num_prompts: int = 40  # per prompt set (part A)
    num_shots: int = 5
    max_new_tokens: int = 256  # part A
    a_batch: int = 16
    algorithms: tuple = ALGORITHMS
    a_settings: tuple = CHAINS + TREES
    b_batches: tuple = (1, 4, 16, 64)
    b_probs: tuple = (0.0001, 0.5, 0.7, 0.85, 0.95, 1.0)
    b_steps: int = 7
    b_prompt_len: int = 128
    b_segment: int = 32
    b_new_tokens: int = 129  # 1 + 16 x 8: at p = 1 the last verify step is not cut
    repeats: int = 3
    big: bool = True


QUICK = Settings(num_prompts=2, num_shots=1, max_new_tokens=16, a_batch=2, algorithms=("NGRAM",),
                 a_settings=((1, 1, 2), (3, 1, 4), (3, 2, 6)), b_batches=(1, 4), b_probs=(0.5, 1.0),
                 b_steps=3, b_prompt_len=32, b_segment=8, b_new_tokens=17, repeats=1, big=False)


def stage(model_path: str, dtype: torch.dtype, tmp: str) -> str:
    """An HF dir every engine loads fast: a GGUF is dequantized (and cast) once, here."""
    if model_path.startswith("shape:") or os.path.isdir(model_path):
        return model_path
    from drafts.truncate import truncate

    ckpt = load_checkpoint(model_path)
    return truncate(model_path, ckpt[0].num_layers, os.path.join(tmp, "target"), dtype, ckpt)


def close(engine) -> None:
    """Engine.shutdown, and what it leaves: the spec decoder holds the router, model, KV cache."""
    engine.shutdown()
    engine.spec_decoder = engine.draft = None
    common.free_memory(engine.device)


def spec_counts(engine) -> tuple:
    """(emitted tokens, verify steps, {accepted drafts: steps}) of the engine so far."""
    state = engine.get_server_info()["internal_states"][0]
    verify = state.get("spec_verify_ct", 0)
    return (state.get("avg_spec_accept_length", 0.0) * verify, verify,
            dict(state.get("spec_accept_histogram", {})))


# -- part A: real drafts -----------------------------------------------------------------------
def draft_paths(args, algorithms) -> dict:
    """{algorithm: draft path (NGRAM: None)}; trained drafts come from drafts.train."""
    from drafts.train import ensure_draft

    return {a: None if a == "NGRAM" else ensure_draft(a, target=args.model_path,
                                                      cache_dir=args.cache_dir)
            for a in algorithms}


def run_set(engine, inputs: dict, params: dict, num_tokens: int) -> dict:
    """All prompts of one set at once: accept length, histograms, tok/s."""
    emitted0, verify0, hist0 = spec_counts(engine)
    outs, seconds = common.timed(lambda: engine.generate(sampling_params=params, **inputs),
                                 engine.device)
    emitted1, verify1, hist1 = spec_counts(engine)
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    return {"num_prompts": len(outs), "verify_steps": verify1 - verify0,
            "accept_length": common.ratio(emitted1 - emitted0, verify1 - verify0),
            "accept_length_mean_req": sum(m["spec_accept_length"] for m in metas) / len(metas),
            "histogram_req": [sum(col) for col in zip(*(m["spec_accept_histogram"]
                                                        for m in metas))],
            "histogram_engine": [hist1.get(k, 0) - hist0.get(k, 0) for k in range(num_tokens)],
            "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds}


def part_a(args, s: Settings, target: str, info: dict) -> None:
    heads = draft_paths(args, s.algorithms)
    gsm8k, _ = build_prompts(s.num_prompts, s.num_shots)
    greedy = {"max_new_tokens": s.max_new_tokens, "temperature": 0}
    sets = {"gsm8k": ({"prompt": gsm8k}, {**greedy, "stop": STOP}),
            "chat": ({"messages": chat_messages(s.num_prompts)}, greedy)}
    tokenizer = load_tokenizer(target)
    longest = max([len(tokenizer.encode(p)) for p in gsm8k] + [256])  # chat prompts: < 256
    kv_tokens = 2 * s.a_batch * (longest + s.max_new_tokens + 32) + 1024
    for algo, draft in heads.items():
        for steps, topk, tokens in s.a_settings:
            if algo == "STANDALONE" and topk > 1:
                print(f"  SKIP STANDALONE ({steps}, {topk}, {tokens}): chains only", flush=True)
                continue
            engine = Engine(
                device=args.device, dtype=args.dtype, show_progress=False,
                model_path=target, max_total_tokens=kv_tokens,
                max_running_requests=s.a_batch, cuda_graph_max_bs=s.a_batch,
                attention_backend=args.attention_backend,
                speculative_algorithm=algo, speculative_draft_model_path=draft,
                speculative_num_steps=steps, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=tokens, **common.PINNED_SPEC)
            engine.generate(prompt=gsm8k[:1], sampling_params={**greedy, "max_new_tokens": 4})
            records = []
            for name, (inputs, params) in sets.items():
                run = run_set(engine, inputs, params, tokens)
                records.append({"bench": "accept", "part": "A", "model": args.model_label,
                                "algorithm": algo, "setting": [steps, topk, tokens],
                                "prompt_set": name, "max_new_tokens": s.max_new_tokens,
                                "num_shots": s.num_shots, "batch_size": s.a_batch, **run,
                                **info, "timestamp": common.now_iso()})
                al = common.fmt(run["accept_length"])
                print(f"  {algo} {(steps, topk, tokens)} {name}: AL {al}, hist "
                      f"{run['histogram_engine']}", flush=True)
            common.append_jsonl(args.out, records)
            close(engine)


# -- part B: synthetic acceptance ------------------------------------------------------------
def measure_b(engine, ids: list, s: Settings) -> dict:
    """Medians of --repeats batches: decode rate (common.batch_decode; the old window from the
    slowest's own first token too), step time at the whole batch, accept length."""
    common.generate_ids(engine, ids, 4)  # warm-up of this batch size
    emitted0, verify0, _ = spec_counts(engine)
    runs, metas = [], []
    for _ in range(s.repeats):
        run, seconds = common.timed(lambda: common.generate_ids(engine, ids, s.b_new_tokens),
                                    engine.device)
        slowest = max(run, key=lambda m: m["e2e_latency"])
        runs.append({**common.batch_decode(run), "e2e_tok_s": len(ids) * s.b_new_tokens / seconds,
                     "decode_tok_s_own_ttft": len(ids) * (s.b_new_tokens - 1) / (
                         slowest["e2e_latency"] - slowest["ttft"])})
        metas += run
    emitted1, verify1, _ = spec_counts(engine)
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)  # 0: no-spec, AL 1
    mid = {k: common.median(r[k] for r in runs) for k in runs[0]}
    return {"decode_tok_s": len(ids) / mid.pop("itl_s"), "step_ms": 1000 * mid.pop("step_s"),
            **mid, "accept_length_engine": common.ratio(emitted1 - emitted0, verify1 - verify0),
            "accept_length": common.ratio(sum(m["completion_tokens"] - 1 for m in metas),
                                          verify) or 1.0}


def part_b(args, s: Settings, model_label: str, target: str, info: dict) -> None:
    """No-spec first, each p, then no-spec again (a fresh engine each): a batch-1 no-spec
    decode swung up to 1.6x between processes on an H200 while the verify held within 1%, so
    each batch size's baseline is the faster of its two no-spec measures (the lower
    efficiency), both kept in the record."""
    most = max(s.b_batches)
    kv = 2 * most * (s.b_prompt_len + s.b_new_tokens + 2 * s.b_steps + 4) + 1024
    base = dict(device=args.device, dtype=args.dtype, show_progress=False, model_path=target,
                skip_tokenizer_init=True, max_total_tokens=kv, max_running_requests=most,
                cuda_graph_max_bs=most, attention_backend=args.attention_backend,
                disable_adaptive_speculation=not args.chain_depth)
    measured = []  # (prob, batch size, measure_b's dict), in the order run
    for prob in (None,) + tuple(s.b_probs) + (None,):
        spec = {} if prob is None else dict(speculative_algorithm="NGRAM", speculative_num_steps=
                                            s.b_steps, speculative_simulate_accept_prob=prob)
        engine = Engine(**base, **spec)
        prompts = repeated_id_prompts(most, s.b_prompt_len, s.b_segment,
                                      engine.model_config.vocab_size)
        for bs in s.b_batches:
            m = measure_b(engine, prompts[:bs], s)
            m["chain_depth"] = common.chain_depth(engine)
            if prob == 1.0 and abs(m["accept_length_engine"] - (s.b_steps + 1)) > 1e-6:
                print(f"  WARNING: p=1 gave AL {m['accept_length_engine']:.3f}, not "
                      f"{s.b_steps + 1}: proposals were not full length", flush=True)
            print(f"  measured {model_label} p={prob} bs={bs}: "
                  f"{common.fmt(m['decode_tok_s'])} tok/s", flush=True)
            measured.append((prob, bs, m))
        close(engine)
    common.append_jsonl(args.out, b_records(args, s, model_label, info, measured))


def b_records(args, s: Settings, model_label: str, info: dict, measured: list) -> list:
    """A record per (p, batch size), no-spec's the faster of its passes (`part_b`)."""
    passes: dict = {}  # batch size -> no-spec's measures, in order
    for prob, bs, m in measured:
        if prob is None:
            passes.setdefault(bs, []).append(m)
    records = []
    for bs, runs in passes.items():
        rates = [r["decode_tok_s"] for r in runs]
        base_m = dict(min(runs, key=lambda r: r["step_ms"]), nospec_tok_s_passes=rates)
        rows = [(None, base_m)] + [(p, m) for p, b, m in measured if p is not None and b == bs]
        for prob, m in rows:
            speedup = common.ratio(m["decode_tok_s"], base_m["decode_tok_s"])
            # Efficiency: a decode step's time over a verify step's, both at the whole batch
            # (1 = verifying costs one decode step). Speedup over the mean accept length, kept
            # as efficiency_mean_al, also charges the slowest request's bad luck at p < 1.
            m.update(speedup=speedup, efficiency=common.ratio(base_m["step_ms"], m["step_ms"]),
                     efficiency_mean_al=common.ratio(speedup, m["accept_length"]))
            records.append({"bench": "accept", "part": "B", "model": model_label,
                            "stack_nodes": not args.no_stack_nodes, "algorithm":
                            "NGRAM" if prob else None, "prob": prob, "num_steps": s.b_steps,
                            "num_draft_tokens": s.b_steps + 1, "batch_size": bs, "prompt_len":
                            s.b_prompt_len, "new_tokens": s.b_new_tokens, "repeats": s.repeats,
                            **m, **info, "timestamp": common.now_iso()})
            print(f"  {model_label} p={prob} bs={bs}: AL {common.fmt(m['accept_length'])}, "
                  f"{common.fmt(m['decode_tok_s'])} tok/s, speedup {common.fmt(speedup)}, "
                  f"efficiency {common.fmt(m['efficiency'])}"
                  + (f" (no-spec passes {', '.join(map(common.fmt, rates))} tok/s)"
                     if prob is None else ""), flush=True)
    return records


def run_all(args, s: Settings) -> None:
    args.model_path = args.model_path or default_model_path()
    args.model_label = os.path.basename(args.model_path.rstrip("/"))
    cfg = EngineConfig(device=args.device, dtype=args.dtype)
    dtype = cfg.resolve_dtype(device := cfg.resolve_device())
    info = {**common.machine_info(device), "dtype": str(dtype).replace("torch.", "")}
    print(f"device {info['device']}, torch {info['torch']}, git {info['git']}, model "
          f"{args.model_path}, dtype {info['dtype']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_accept_") as tmp:
        target = stage(args.model_path, dtype, tmp)
        if "A" in args.parts:
            part_a(args, s, target, info)
        if "B" in args.parts:
            part_b(args, s, args.model_label, target, info)
    if "B" in args.parts and s.big and not args.skip_8b:
        part_b(args, s, BIG_MODEL, BIG_MODEL, info)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default="auto", help="chains and trees")
    p.add_argument("--parts", nargs="+", choices=("A", "B"), default=["A", "B"])
    p.add_argument("--skip-8b", action="store_true", help=f"part B without {BIG_MODEL}")
    p.add_argument("--cache-dir", default=".cache/drafts", help="trained heads (made if missing)")
    p.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=None)
    p.add_argument("--a-settings", nargs="+", default=None, metavar="STEPS,TOPK,TOKENS",
                   type=common.parse_setting, help="part A's (default: five chains, two trees)")
    p.add_argument("--b-batches", nargs="+", type=int, default=None)
    p.add_argument("--b-probs", nargs="+", type=float, default=None)
    p.add_argument("--chain-depth", action="store_true", help="B: chain depth per batch size")
    p.add_argument("--no-stack-nodes", action="store_true", help="B: split-K verify with a "
                   "program a node (TritonAttnBackend.stack_chain_nodes off), to compare")
    for name in ("num_prompts", "num_shots", "max_new_tokens", "a_batch", "b_steps",
                 "b_prompt_len", "b_new_tokens", "repeats"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {getattr(Settings(), name)}")
    p.add_argument("--hist-setting", default="7,1,8", help="steps,topk,tokens of the histogram")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads (--quick: 1)")
    p.add_argument("--quick", action="store_true", help="CPU smoke sizes (no 8B, NGRAM only)")
    p.add_argument("--out", default=None, help=f"default {common.RESULTS_DIR / 'accept.jsonl'}")
    p.add_argument("--compare", metavar="LABEL=FILE", nargs="+", default=None,
                   help="plot part B's efficiency of these runs side by side into --out (a PNG)")
    p.add_argument("--compare-metric", choices=("efficiency", "tok_s"), default="efficiency",
                   help="--compare: framework efficiency, or decode tok/s (no-spec included)")
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the tables and plots from an existing JSON-lines file")
    args = p.parse_args(argv)
    if args.quick and args.cpu_threads is None:
        args.cpu_threads = 1  # a smoke run: one thread is steadier on a shared, small CPU
    if args.quick and args.out is None:
        p.error("--quick needs --out: smoke-run lines stay out of benchmarks/results")
    args.out = args.out or str(common.RESULTS_DIR / "accept.jsonl")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare:
        labelled = [c.split("=", 1) for c in args.compare]
        print(f"plot: {plot_compare(labelled, args.out, args.compare_metric)}")
        return
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.no_stack_nodes:
        from specpcg.attention.triton_backend import TritonAttnBackend
        TritonAttnBackend.stack_chain_nodes = False
    if not args.table_only:
        given = {f: getattr(args, f) for f in Settings.__dataclass_fields__
                 if getattr(args, f, None) is not None}
        given = {f: tuple(v) if isinstance(v, list) else v for f, v in given.items()}
        run_all(args, replace(QUICK if args.quick else Settings(), **given))
        print(f"\nappended to {args.out}\n")
    path = args.table_only or args.out
    records = common.read_jsonl(path)
    print(render_tables(records))
    hist = common.parse_setting(args.hist_setting)
    for png in render_plots(records, path, hist):
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
