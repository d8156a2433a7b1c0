"""Speculative decoding on few-shot GSM8K: accept length, speed, and unchanged answers.

Systems: no-spec, NGRAM, STANDALONE (draft: the target's first --draft-layers layers, cut by
drafts.truncate into a temp dir), each with piecewise CUDA graphs on and off, at batch 1 (the
first --bs1-questions, one at a time) and 16 (the first --num-questions at once,
max_running_requests=16); greedy, stop strings of specpcg.gsm8k. Per run: accept length (run
average from the engine's counters; mean over requests), output tokens/s (completion tokens /
wall time), speedup over no-spec (same graphs, same batch), accuracy next to no-spec's, and the
fraction of outputs identical to no-spec's. References at batch 1 on the first --hf-questions:
HF `generate` (dynamic cache), with `prompt_lookup_num_tokens=10`, and with the same draft as
`assistant_model`; speedups over HF plain. A GGUF target is converted once (to --dtype) into a
temp HF dir that every engine and HF load. JSON lines to --out, a table, a PNG next to --out.

    python benchmarks/bench_spec.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_spec.py --quick --out /tmp/spec.jsonl     # CPU smoke run
    python benchmarks/bench_spec.py --table-only benchmarks/results/spec.jsonl
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import common

common.add_repo_to_path()

SYSTEMS = {"nospec": None, "ngram": "NGRAM", "standalone": "STANDALONE"}
NAMES = {"nospec": "no-spec", "ngram": "NGRAM", "standalone": "STANDALONE", "hf_plain": "HF plain",
         "hf_prompt_lookup": "HF prompt lookup", "hf_assisted": "HF assisted"}
# plot series: each specpcg algorithm next to its HF counterpart
SERIES = {"n-gram (NGRAM / HF prompt lookup)": ("ngram", "hf_prompt_lookup"),
          "draft model (STANDALONE / HF assisted)": ("standalone", "hf_assisted")}


@dataclass(frozen=True)
class Settings:
    num_shots: int = 5
    max_new_tokens: int = 256
    bs1_questions: int = 30
    num_questions: int = 200
    batch_size: int = 16
    hf_questions: int = 10


QUICK = Settings(num_shots=1, max_new_tokens=16, bs1_questions=2, num_questions=2, batch_size=2,
                 hf_questions=0)


# -- models ----------------------------------------------------------------------------------
def stage_models(args, dtype, tmp: str) -> tuple[str, str]:
    """(target path, draft dir): the draft cut from the target; a GGUF target converted once."""
    from drafts.truncate import truncate
    from specpcg.models.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model_path)
    target = args.model_path
    if not os.path.isdir(target):  # every engine would dequantize the GGUF again
        target = truncate(target, checkpoint[0].num_layers, os.path.join(tmp, "target"), dtype,
                          checkpoint)
    draft = truncate(args.model_path, args.draft_layers, os.path.join(tmp, "draft"), dtype,
                     checkpoint)
    return target, draft


def make_engine(args, s: Settings, system: str, pcg: bool, paths, kv_tokens: int):
    from specpcg import Engine

    kw = dict(model_path=paths[0], device=args.device, dtype=args.dtype,
              attention_backend=args.attention_backend, max_total_tokens=kv_tokens,
              max_running_requests=s.batch_size, cuda_graph_max_bs=s.batch_size,
              disable_piecewise_cuda_graph=not pcg, show_progress=False)
    if SYSTEMS[system]:
        kw.update(speculative_algorithm=SYSTEMS[system], speculative_num_steps=args.num_steps)
    if SYSTEMS[system] == "STANDALONE":
        kw["speculative_draft_model_path"] = paths[1]
    return Engine(**kw)


# -- one run -----------------------------------------------------------------------------------
def spec_counts(engine) -> tuple[float, int]:
    """(tokens emitted by verify steps, verify steps) so far; (0, 0) without spec decoding."""
    state = engine.get_server_info()["internal_states"][0]
    verify = state.get("spec_verify_ct", 0)
    return state.get("avg_spec_accept_length", 0.0) * verify, verify


def run_engine(engine, prompts: list, batch_size: int, params: dict, bar) -> dict:
    """Outputs of `prompts` (one at a time at batch 1, else all at once), timed, with the run's
    accept length and the runners that served the prompts' prefill (EXTEND) forwards."""
    def generate():
        if batch_size > 1:
            outs = engine.generate(prompt=prompts, sampling_params=params)
            bar.update(len(prompts))
            return outs
        outs = []
        for prompt in prompts:
            outs.append(engine.generate(prompt=prompt, sampling_params=params))
            bar.update(1)
        return outs

    emitted0, verify0 = spec_counts(engine)
    (outs, seconds), runners = common.served_by(
        engine, "EXTEND", lambda: common.timed(generate, engine.device))
    emitted1, verify1 = spec_counts(engine)
    metas = [o["meta_info"] for o in outs]
    return {"outputs": [(o["output_ids"], o["text"]) for o in outs], "seconds": seconds,
            "accept_length": common.ratio(emitted1 - emitted0, verify1 - verify0),
            "accept_length_mean_req": (sum(m["spec_accept_length"] for m in metas) / len(metas)
                                       if "spec_accept_length" in metas[0] else None),
            "prefill_runners": sorted(runners)}


def summarize(run: dict, golds: list, base: dict | None) -> dict:
    """The JSON fields of a run; base: the reference run (no-spec, HF plain) or None if it is."""
    from specpcg.gsm8k import extract_answer

    outputs = run.pop("outputs")
    num_tokens = sum(len(ids) for ids, _ in outputs)
    preds = [extract_answer(text) for _, text in outputs]
    accuracy = sum(p == g for p, g in zip(preds, golds)) / len(outputs)
    ref_ids = [ids for ids, _ in (base or {}).get("outputs", outputs)]
    tok_s = num_tokens / run["seconds"]
    rec = {**run, "num_questions": len(outputs), "output_tokens": num_tokens,
           "output_tok_s": tok_s, "accuracy": accuracy,
           "baseline_accuracy": base["accuracy"] if base else accuracy,
           "speedup": tok_s / base["output_tok_s"] if base else 1.0,
           "identical_frac": sum(a == b for (a, _), b in zip(outputs, ref_ids)) / len(outputs)}
    run["outputs"] = outputs  # kept in memory: later runs compare against it
    if base and rec["accuracy"] != rec["baseline_accuracy"]:
        print(f"  WARNING: accuracy {accuracy:.3f} differs from the baseline's "
              f"{rec['baseline_accuracy']:.3f}", flush=True)
    return rec


# -- specpcg systems ---------------------------------------------------------------------------
def gsm8k_inputs(s: Settings, num_questions: int):
    from specpcg.gsm8k import STOP, build_prompts

    prompts, golds = build_prompts(num_questions, s.num_shots)
    return prompts, golds, {"max_new_tokens": s.max_new_tokens, "temperature": 0, "stop": STOP}


def run_specpcg(args, s: Settings, paths, info: dict) -> None:
    from tqdm import tqdm

    from specpcg.tokenizer import load_tokenizer

    prompts, golds, params = gsm8k_inputs(s, max(s.bs1_questions, s.num_questions))
    tokenizer = load_tokenizer(paths[0])
    longest = max(len(tokenizer.encode(p)) for p in prompts)
    kv_tokens = 2 * s.batch_size * (longest + s.max_new_tokens + 2 * args.num_steps + 2) + 1024
    phases = ((1, s.bs1_questions), (s.batch_size, s.num_questions))
    for pcg in (True, False):
        bases: dict = {}
        for system in SYSTEMS:
            engine = make_engine(args, s, system, pcg, paths, kv_tokens)
            engine.generate(prompt=prompts[:2], sampling_params={**params, "max_new_tokens": 8})
            bar = tqdm(total=sum(n for _, n in phases), unit="q",
                       desc=f"{NAMES[system]}, PCG {'on' if pcg else 'off'}")
            records = []
            for bs, n in phases:
                run = run_engine(engine, prompts[:n], bs, params, bar)
                rec = summarize(run, golds[:n], bases.get(bs))
                bases.setdefault(bs, run | {k: rec[k] for k in ("accuracy", "output_tok_s")})
                records.append({"bench": "spec", "system": system, "pcg": pcg, "batch_size": bs,
                                **rec, **info, "pcg_enabled": engine.get_server_info()
                                ["piecewise_cuda_graph"]["enabled"], "timestamp": common.now_iso()})
            bar.close()
            for r in records:
                print(f"  bs={r['batch_size']:<3d} {common.fmt(r['output_tok_s'])} tok/s, speedup "
                      f"{common.fmt(r['speedup'])}, AL {common.fmt(r['accept_length'])}, acc "
                      f"{common.fmt(r['accuracy'])}, identical {common.fmt(r['identical_frac'])}")
            common.append_jsonl(args.out, records)
            engine.shutdown()
            common.free_memory(engine.device)


# -- HF transformers references ------------------------------------------------------------------
def hf_generate(model, tokenizer, prompt: str, num_new: int, extra: dict) -> tuple[list, str]:
    """(new ids up to the stop string, text). A stopping criterion of our own, not generate's
    `stop_strings`: assisted generation hands those to the assistant, which has no tokenizer."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from specpcg.gsm8k import STOP

    class StopText(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # an assisted step adds <= 21 tokens
            tail = tokenizer.decode(input_ids[0, max(prompt_len, input_ids.shape[1] - 32):])
            return torch.full(input_ids.shape[:1], any(x in tail for x in STOP),
                              dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor([tokenizer.encode(prompt)], device=model.device)  # [1, prompt_len]
    prompt_len = ids.shape[1]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=num_new, pad_token_id=tokenizer.eos_token_id,
                         stopping_criteria=StoppingCriteriaList([StopText()]), **extra)
    new = out[0, prompt_len:].tolist()
    # NOTE: a verify step can accept tokens past the stop string; count only those before it.
    ends = [k for k in range(1, len(new) + 1)
            if any(x in tokenizer.decode(new[max(0, k - 8):k]) for x in STOP)]
    new = new[:ends[0]] if ends else new
    return new, tokenizer.decode(new, skip_special_tokens=True)


def run_hf(args, s: Settings, paths, device, dtype, info: dict) -> None:
    from tqdm import tqdm

    from specpcg.tokenizer import load_tokenizer

    prompts, golds, _ = gsm8k_inputs(s, s.hf_questions)
    tokenizer = load_tokenizer(paths[0]).hf_tokenizer
    model = common.load_hf_model(paths[0], device, dtype)
    assistant = common.load_hf_model(paths[1], device, dtype)
    base = None
    for system, extra in (("hf_plain", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10}),
                          ("hf_assisted", {"assistant_model": assistant})):
        hf_generate(model, tokenizer, prompts[0], 8, extra)  # warm-up
        bar = tqdm(prompts, desc=NAMES[system], unit="q")
        outputs, seconds = common.timed(
            lambda: [hf_generate(model, tokenizer, p, s.max_new_tokens, extra) for p in bar], device)
        run = {"outputs": outputs, "seconds": seconds, "accept_length": None,
               "accept_length_mean_req": None}
        rec = summarize(run, golds, base)
        base = base or run | {k: rec[k] for k in ("accuracy", "output_tok_s")}
        print(f"  {common.fmt(rec['output_tok_s'])} tok/s, speedup {common.fmt(rec['speedup'])}, "
              f"acc {common.fmt(rec['accuracy'])}", flush=True)
        common.append_jsonl(args.out, [{"bench": "spec", "system": system, "pcg": None,
                                        "batch_size": 1, **rec, **info,
                                        "timestamp": common.now_iso()}])
    common.free_memory(device)


def run_all(args, s: Settings) -> None:
    import torch

    from specpcg.config import EngineConfig
    from specpcg.models.loader import default_model_path

    args.model_path = args.model_path or default_model_path()
    cfg = EngineConfig(device=args.device, dtype=args.dtype)
    device = cfg.resolve_device()
    dtype = cfg.resolve_dtype(device)
    args.dtype = str(dtype).replace("torch.", "")
    info = {**common.machine_info(device), "dtype": args.dtype, "model": args.model_path,
            "num_shots": s.num_shots, "max_new_tokens": s.max_new_tokens,
            "draft_layers": args.draft_layers, "num_steps": args.num_steps}
    print(f"device {info['device']}, torch {info['torch']}, transformers {info['transformers']}, "
          f"git {info['git']}, model {args.model_path}, dtype {args.dtype}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_spec_") as tmp:
        paths = stage_models(args, dtype, tmp)
        run_specpcg(args, s, paths, info)
        if s.hf_questions > 0 and not args.skip_hf:
            with torch.inference_mode():
                run_hf(args, s, paths, device, dtype, info)


# -- reporting -------------------------------------------------------------------------------
def latest_rows(records: list[dict]) -> list[dict]:
    """The latest line of each (system, graphs, batch size), specpcg first, HF last."""
    table, _ = common.latest_by(records, "spec", lambda r: (r["batch_size"], r["pcg"]))
    order = {True: 0, False: 1, None: 2}
    keys = sorted(table, key=lambda k: (k[1] is None, k[0], order[k[1]]))
    return [table[k][sys] for k in keys for sys in NAMES if sys in table[k]]


def render_table(records: list[dict]) -> str:
    pcg = {True: "on", False: "off", None: "-"}
    columns = [("system", lambda r: NAMES[r["system"]]), ("PCG", lambda r: pcg[r["pcg"]]),
               ("batch", lambda r: str(r["batch_size"])), ("questions", lambda r: str(r["num_questions"])),
               ("AL (run)", lambda r: r["accept_length"]),
               ("AL (mean/req)", lambda r: r["accept_length_mean_req"]),
               ("tok/s", lambda r: r["output_tok_s"]), ("speedup", lambda r: r["speedup"]),
               ("accuracy", lambda r: r["accuracy"]), ("baseline acc", lambda r: r["baseline_accuracy"]),
               ("identical", lambda r: r["identical_frac"])]
    return common.column_table(latest_rows(records), columns)


def render_plot(records: list[dict], path) -> None:
    rows = latest_rows(records)
    groups = sorted({(r["batch_size"], r["pcg"]) for r in rows},
                    key=lambda g: (g[1] is None, g[0], g[1] is False))
    labels = [f"HF bs{bs}" if p is None else f"bs{bs} PCG {'on' if p else 'off'}" for bs, p in groups]
    by = {(r["batch_size"], r["pcg"], r["system"]): r for r in rows}

    def values(field, hf: bool):
        return {name: [(by.get((bs, p, syss[p is None])) or {}).get(field) for bs, p in groups
                       if hf or p is not None] for name, syss in SERIES.items()}

    last = rows[-1]
    panels = [{"title": "speedup over no-spec (HF: over HF plain)", "ylabel": "x", "labels": labels,
               "values": values("speedup", True)},
              {"title": "accept length (tokens per verify, run average)", "ylabel": "tokens",
               "labels": [lb for lb, g in zip(labels, groups) if g[1] is not None],
               "values": values("accept_length", False)}]
    title = (f"speculative decoding, GSM8K {last['num_shots']}-shot greedy, max {last['max_new_tokens']} "
             f"new tokens, draft {last['draft_layers']} layers, {last['num_steps']} steps; "
             f"{last['device']} ({last['dtype']}, torch {last['torch']}, git {last['git']})")
    common.grouped_bar_plot(panels, list(SERIES), path, title)


def report(records: list[dict], out_path) -> None:
    png = Path(out_path).with_suffix(".png")
    print(render_table(records))
    try:
        render_plot(records, png)
    except ImportError as exc:  # the lines and table stand without a plot; --table-only redraws
        print(f"\nno plot ({exc}); pip install matplotlib, then rerun with --table-only")
        return
    print(f"\nplot: {png}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--draft-layers", type=int, default=8, help="STANDALONE draft: first K layers")
    p.add_argument("--num-steps", type=int, default=3, help="speculative_num_steps")
    for name in ("num-shots", "max-new-tokens", "bs1-questions", "num-questions", "batch-size",
                 "hf-questions"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"default {getattr(Settings(), name.replace('-', '_'))}")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers references")
    p.add_argument("--quick", action="store_true", help="CPU smoke sizes (HF only with --hf-questions)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "spec.jsonl"))
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the table and plot from an existing JSON-lines file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_only:
        report(common.read_jsonl(args.table_only), args.table_only)
        return
    given = {f: getattr(args, f) for f in Settings.__dataclass_fields__ if getattr(args, f) is not None}
    run_all(args, replace(QUICK if args.quick else Settings(), **given))
    print(f"\nappended to {args.out}\n")
    report(common.read_jsonl(args.out), args.out)


if __name__ == "__main__":
    main()
