"""Speculative decoding on few-shot GSM8K: accept length, speed, and unchanged answers.

no-spec, NGRAM, STANDALONE (draft: the target's first --draft-layers layers, by drafts.truncate,
or a trained --draft-path), and EAGLE with a trained --head-path at (--head-num-steps, 1, +1),
PCG on and off, batch 1 (--bs1-questions, one at a time) and 16 (--num-questions at once,
max_running_requests=16). Per run: accept length (engine counters' run average; mean over
requests), output tok/s (completion tokens / wall time), speedup and identical outputs against
no-spec (same PCG, batch), accuracy and no-spec's. HF references at batch 1 (--hf-questions):
plain `generate`, `prompt_lookup_num_tokens=10`, the draft as `assistant_model`; speedups over
plain. A GGUF target is converted once (to --dtype) into a temp HF dir that all systems load.

    python benchmarks/bench_spec.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_spec.py --quick --out /tmp/spec.jsonl     # CPU smoke run
    python benchmarks/bench_spec.py --table-only benchmarks/results/spec.jsonl
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

import common
import hf_reference

common.add_repo_to_path()
from drafts.truncate import truncate  # noqa: E402
from specpcg import Engine  # noqa: E402
from specpcg.config import EngineConfig  # noqa: E402
from specpcg.gsm8k import STOP, build_prompts, extract_answer  # noqa: E402
from specpcg.models.loader import default_model_path, load_checkpoint  # noqa: E402
from specpcg.tokenizer import load_tokenizer  # noqa: E402

SYSTEMS = {"nospec": None, "ngram": "NGRAM", "standalone": "STANDALONE", "eagle": "EAGLE"}
NAMES = {"nospec": "no-spec", "ngram": "NGRAM", "standalone": "STANDALONE", "eagle": "EAGLE",
         "hf_plain": "HF plain",
         "hf_prompt_lookup": "HF prompt lookup", "hf_assisted": "HF assisted"}
SERIES = {"n-gram (NGRAM / HF prompt lookup)": ("ngram", "hf_prompt_lookup"),
          "draft model (STANDALONE / HF assisted)": ("standalone", "hf_assisted")}  # plot


@dataclass(frozen=True)
class Settings:
    num_shots: int = 5
    max_new_tokens: int = 256
    bs1_questions: int = 30
    num_questions: int = 200
    batch_size: int = 16
    hf_questions: int = 10


QUICK = Settings(1, 16, 2, 2, 2, 0)  # 1 shot, 16 new tokens, 2 questions at bs 1 and 2, no HF


def stage_models(args, dtype, tmp: str) -> tuple[str, str]:
    """(target path, draft dir): the draft cut from the target; a GGUF target converted once
    (else every engine dequantizes it again)."""
    ckpt, target = load_checkpoint(args.model_path), args.model_path
    if not os.path.isdir(target):
        target = truncate(target, ckpt[0].num_layers, os.path.join(tmp, "target"), dtype, ckpt)
    if args.draft_path:
        return target, args.draft_path
    return target, truncate(args.model_path, args.draft_layers, os.path.join(tmp, "draft"),
                            dtype, ckpt)


def make_engine(args, s: Settings, system: str, pcg: bool, paths, kv_tokens: int):
    kw = dict(model_path=paths[0], device=args.device, dtype=args.dtype,
              attention_backend=args.attention_backend, max_total_tokens=kv_tokens,
              max_running_requests=s.batch_size, cuda_graph_max_bs=s.batch_size,
              disable_piecewise_cuda_graph=not pcg, show_progress=False, **common.PINNED_SPEC)
    if system == "eagle":  # a trained head at its own chain length: (k, 1, k + 1)
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=args.head_num_steps,
                  speculative_draft_model_path=args.head_path)
    elif SYSTEMS[system]:
        kw.update(speculative_algorithm=SYSTEMS[system], speculative_num_steps=args.num_steps,
                  speculative_draft_model_path=paths[1] if system == "standalone" else None)
    return Engine(**kw)


# -- one run -----------------------------------------------------------------------------------
def run_engine(engine, prompts: list, batch_size: int, params: dict, bar) -> dict:
    """Outputs of `prompts` (one at a time at batch 1, else all at once), timed, with the run's
    accept length and the runners that served the prompts' prefill (EXTEND) forwards."""
    def generate():
        outs = []
        for group in [prompts] if batch_size > 1 else [[p] for p in prompts]:
            outs += engine.generate(prompt=group, sampling_params=params)
            bar.update(len(group))
        return outs

    def spec_counts():  # (tokens emitted by verify steps, verify steps); (0, 0) with no spec
        state = engine.get_server_info()["internal_states"][0]
        verify = state.get("spec_verify_ct", 0)
        return state.get("avg_spec_accept_length", 0.0) * verify, verify

    emitted0, verify0 = spec_counts()
    (outs, seconds), runners = common.served_by(
        engine, "EXTEND", lambda: common.timed(generate, engine.device))
    emitted1, verify1 = spec_counts()
    metas = [o["meta_info"] for o in outs]
    return {"outputs": [(o["output_ids"], o["text"]) for o in outs], "seconds": seconds,
            "accept_length": common.ratio(emitted1 - emitted0, verify1 - verify0),
            "accept_length_mean_req": (sum(m["spec_accept_length"] for m in metas) / len(metas)
                                       if "spec_accept_length" in metas[0] else None),
            "prefill_runners": sorted(runners)}


def summarize(run: dict, golds: list, base: dict | None) -> dict:
    """The JSON fields of a run; base: the reference run (no-spec, HF plain), None for itself."""
    outputs = run["outputs"]
    num_tokens = sum(len(ids) for ids, _ in outputs)
    accuracy = sum(extract_answer(t) == g for (_, t), g in zip(outputs, golds)) / len(outputs)
    base = base or {**run, "accuracy": accuracy, "output_tok_s": num_tokens / run["seconds"]}
    rec = {**{k: v for k, v in run.items() if k != "outputs"}, "num_questions": len(outputs),
           "output_tokens": num_tokens, "output_tok_s": num_tokens / run["seconds"],
           "accuracy": accuracy, "baseline_accuracy": base["accuracy"],
           "speedup": num_tokens / run["seconds"] / base["output_tok_s"],
           "identical_frac": sum(a == b for (a, _), (b, _) in zip(outputs, base["outputs"]))
           / len(outputs)}
    if accuracy != base["accuracy"]:
        print(f"  WARNING: accuracy {accuracy:.3f} differs from the baseline's "
              f"{base['accuracy']:.3f}", flush=True)
    return rec


def emit(out_path, records: list[dict]) -> None:
    for r in records:
        print(f"  bs={r['batch_size']}: " + ", ".join(f"{f} {common.fmt(r.get(f))}" for f in (
            "output_tok_s", "speedup", "accept_length", "accuracy", "identical_frac")), flush=True)
    common.append_jsonl(out_path, records)


# -- the systems -------------------------------------------------------------------------------
def run_specpcg(args, s: Settings, paths, info: dict) -> None:
    prompts, golds = build_prompts(max(s.bs1_questions, s.num_questions), s.num_shots)
    params = {"max_new_tokens": s.max_new_tokens, "temperature": 0, "stop": STOP}
    longest = max(len(load_tokenizer(paths[0]).encode(p)) for p in prompts)
    kv_tokens = 2 * s.batch_size * (longest + s.max_new_tokens + 2 * args.num_steps + 2) + 1024
    phases = ((1, s.bs1_questions), (s.batch_size, s.num_questions))
    for pcg in (True, False):
        bases: dict = {}  # batch size -> the no-spec run
        for system in SYSTEMS:
            if system == "eagle" and not args.head_path:
                continue
            engine = make_engine(args, s, system, pcg, paths, kv_tokens)
            engine.generate(prompt=prompts[:2], sampling_params={**params, "max_new_tokens": 8})
            bar = tqdm(total=sum(n for _, n in phases), unit="q",
                       desc=f"{NAMES[system]}, PCG {'on' if pcg else 'off'}")
            tags = {"bench": "spec", "system": system, "pcg": pcg, **info, "pcg_enabled":
                    engine.get_server_info()["piecewise_cuda_graph"]["enabled"]}
            records = []
            for bs, n in phases:
                run = run_engine(engine, prompts[:n], bs, params, bar)
                rec = summarize(run, golds[:n], bases.get(bs))
                bases.setdefault(bs, {**run, **rec})
                records.append({**tags, "batch_size": bs, **rec, "timestamp": common.now_iso()})
            bar.close()
            emit(args.out, records)
            engine.shutdown()
            common.free_memory(engine.device)


def hf_generate(model, tokenizer, prompt: str, num_new: int, extra: dict) -> tuple[list, str]:
    """(new ids up to the stop string, text). A stopping criterion of our own, not generate's
    `stop_strings`: assisted generation hands those to the assistant, which has no tokenizer."""
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
    new = new[:next((k for k in range(1, len(new) + 1)
                     if any(x in tokenizer.decode(new[max(0, k - 8):k]) for x in STOP)), None)]
    return new, tokenizer.decode(new, skip_special_tokens=True)


def run_hf(args, s: Settings, paths, device, dtype, info: dict) -> None:
    prompts, golds = build_prompts(s.hf_questions, s.num_shots)
    tokenizer = load_tokenizer(paths[0]).hf_tokenizer
    model = hf_reference.load_hf_model(paths[0], device, dtype)
    assistant = hf_reference.load_hf_model(paths[1], device, dtype)
    base = None
    for system, extra in (("hf_plain", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10}),
                          ("hf_assisted", {"assistant_model": assistant})):
        hf_generate(model, tokenizer, prompts[0], 8, extra)  # warm-up
        bar = tqdm(prompts, desc=NAMES[system], unit="q")
        outputs, seconds = common.timed(lambda: [
            hf_generate(model, tokenizer, p, s.max_new_tokens, extra) for p in bar], device)
        run = {"outputs": outputs, "seconds": seconds}
        rec = summarize(run, golds, base)
        base = base or {**run, **rec}
        emit(args.out, [{"bench": "spec", "system": system, "pcg": None, "batch_size": 1, **rec,
                         **info, "timestamp": common.now_iso()}])
    common.free_memory(device)


def run_all(args, s: Settings) -> None:
    args.model_path = args.model_path or default_model_path()
    cfg = EngineConfig(device=args.device, dtype=args.dtype)
    device = cfg.resolve_device()
    dtype = cfg.resolve_dtype(device)
    args.dtype = str(dtype).replace("torch.", "")
    info = {**common.machine_info(device), "dtype": args.dtype, "model": args.model_path,
            "num_shots": s.num_shots, "max_new_tokens": s.max_new_tokens,
            "draft_layers": None if args.draft_path else args.draft_layers,
            "draft_path": args.draft_path, "num_steps": args.num_steps,
            "head_path": args.head_path, "head_num_steps": args.head_num_steps}
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
    """The latest line of each (system, graphs, batch size): specpcg by batch, then HF."""
    table, _ = common.latest_by(records, "spec", lambda r: (r["batch_size"], r["pcg"]))
    keys = sorted(table, key=lambda k: (k[1] is None, k[0], k[1] is False))
    return [table[k][sys] for k in keys for sys in NAMES if sys in table[k]]


def render_table(records: list[dict]) -> str:
    fields = {"batch": "batch_size", "questions": "num_questions", "AL (run)": "accept_length",
              "AL (mean/req)": "accept_length_mean_req", "tok/s": "output_tok_s",
              "speedup": "speedup", "accuracy": "accuracy", "baseline acc": "baseline_accuracy",
              "identical": "identical_frac"}
    pcg = {True: "on", False: "off", None: "-"}
    columns = [("system", lambda r: NAMES[r["system"]]), ("PCG", lambda r: pcg[r["pcg"]])] + [
        (h, lambda r, f=f: r.get(f)) for h, f in fields.items()]
    return common.column_table(latest_rows(records), columns)


def render_plot(records: list[dict], path) -> None:
    rows = latest_rows(records)
    by = {(r["batch_size"], r["pcg"], r["system"]): r for r in rows}
    groups = list(dict.fromkeys((r["batch_size"], r["pcg"]) for r in rows))  # in row order
    label = {True: "PCG on", False: "PCG off", None: "HF"}

    def panel(title: str, field: str, hf: bool) -> dict:
        keys = [g for g in groups if hf or g[1] is not None]
        return {"title": title, "ylabel": field.replace("_", " "),
                "labels": [f"bs{bs} {label[p]}" for bs, p in keys],
                "values": {name: [by.get((bs, p, pair[p is None]), {}).get(field) for bs, p in keys]
                           for name, pair in SERIES.items()}}

    last = rows[-1]
    title = (f"spec decoding, GSM8K {last['num_shots']}-shot greedy, <= {last['max_new_tokens']} "
             f"new tokens, draft {_draft_label(last)}, {last['num_steps']} steps; "
             f"{last['device']} ({last['dtype']}, torch {last['torch']}, git {last['git']})")
    common.grouped_bar_plot([panel("speedup over no-spec (HF: over HF plain)", "speedup", True),
                             panel("accept length (run average)", "accept_length", False)],
                            list(SERIES), path, title)


def _draft_label(rec: dict) -> str:
    if rec.get("draft_path"):
        return "trained (drafts.train)"
    return f"{rec['draft_layers']} layers"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--draft-layers", type=int, default=8, help="STANDALONE draft: first K layers")
    p.add_argument("--draft-path", default=None,
                   help="STANDALONE and HF assisted draft: a trained draft directory "
                        "(python -m drafts.train) instead of the first --draft-layers layers")
    p.add_argument("--num-steps", type=int, default=3, help="speculative_num_steps")
    p.add_argument("--head-path", default=None,
                   help="also run EAGLE with this trained head (drafts.train.ensure_draft)")
    p.add_argument("--head-num-steps", type=int, default=7, help="EAGLE's speculative_num_steps")
    for name in Settings.__dataclass_fields__:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {getattr(Settings(), name)}")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers references")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke sizes (HF only with --hf-questions)")
    p.add_argument("--out", default=None, help=f"default {common.RESULTS_DIR / 'spec.jsonl'}")
    p.add_argument("--table-only", metavar="FILE", default=None,
                   help="re-render the table and plot from an existing JSON-lines file")
    args = p.parse_args(argv)
    if args.quick and args.out is None:
        p.error("--quick needs --out: smoke-run lines stay out of benchmarks/results")
    args.out = args.out or str(common.RESULTS_DIR / "spec.jsonl")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.table_only:
        given = {f: getattr(args, f) for f in Settings.__dataclass_fields__
                 if getattr(args, f) is not None}
        run_all(args, replace(QUICK if args.quick else Settings(), **given))
        print(f"\nappended to {args.out}\n")
    common.render_results(args.table_only or args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
