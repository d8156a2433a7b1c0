"""Adaptive speculation against no-spec with each engine alone in a process of its own.

bench_adaptive.py keeps its engines alive side by side in one process, their timed batches
taking turns. Beside others an engine runs slower, and not by the same share: on one H200 a
no-spec engine of the default model decoded batches of 16 at 15,162-15,238 tok/s beside two
engines with a STANDALONE draft (cb98842) and at 16,583-16,602 alone (80fc1bd), while pinned
speculation ran alike both ways (15,479-15,770 beside, 15,705-15,716 alone). A user runs one
engine, so side by side favoured speculation by up to a tenth.

Here each system runs in a worker process of its own, one after another, the order reversed
every other pass (--passes), so drift of the device lands on every system alike. A worker runs
one untimed batch and --repeats timed ones of each size (bench_adaptive's interleaved_rates with
one engine). A cell's speedup is the median of the system's timed batches over all passes
against no-spec's. Lines ("bench": "adaptive_alone") carry bench_adaptive's fields; before
them, each worker's result is written as it ends ("bench": "adaptive_alone_worker").

    python benchmarks/bench_alone.py [--skip-ngram] [--drafts STANDALONE=DIR]
        [--untrained EAGLE3] [--systems no-spec pinned adaptive] [--batches 1 4 16 64]
        [--setting 3,1,4] [--repeats 3] [--passes 2] [--tree NAME=DIR [--tree-systems ...]]
        [--alone-prompts N] [--out FILE]

Each line says how many of a system's outputs have no-spec's text for the same prompt
(`texts_as_no_spec`): in bf16 a near tie can turn a speculative step's token from a plain one's
and the answer with it, and a draft accepts more on one answer than on another, so rates
compare like for like only over the same texts. With --alone-prompts N a batch of one is N
prompts one after another, each alone, rather than the first prompt's answer alone.

With --tree old=DIR the systems also run from another checkout at DIR (its own worker and
code), as `plain@old` and so on: a change measured against the commit before it, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import common

common.add_repo_to_path()

BENCH = "adaptive_alone"
SCRIPT = "bench_alone.py"  # a worker runs this file of its checkout
WORKER_BENCH = "adaptive_alone_worker"  # one worker's result, written as it ends


def worker(spec: dict) -> dict:
    """One system's engine alone (spec: run_passes' worker spec, and "engine_options": more
    Engine arguments): per batch size its timed batches' rates, plain tokens, stalls, switches
    and adaptive buckets; and the machine."""
    from bench_adaptive import (HOLDS, engine_kwargs, interleaved_rates, plain_tokens,
                                prompts_for, switch_counts)
    from specpcg import Engine
    from stalls import StallWatch

    system, batches = spec["system"], spec["batches"]
    engine = Engine(model_path=spec["model_path"], device=spec["device"],
                    max_running_requests=max(batches), cuda_graph_max_bs=max(batches),
                    show_progress=False, **spec.get("engine_options", {}),
                    **engine_kwargs(system, spec["algorithm"], spec["draft"],
                                    tuple(spec["setting"])))
    if system in HOLDS:
        HOLDS[system](engine)
    watch = StallWatch(engine.device)
    alone = spec.get("alone_prompts", 1)
    prompts = prompts_for(engine, max(*batches, alone), spec["prompt_len"])
    params = {"max_new_tokens": spec["max_new_tokens"], "temperature": 0, "ignore_eos": True}
    out = {"machine": common.machine_info(engine.device), "batches": {}}
    for bs in batches:
        before = switch_counts(engine)
        solo = bs == 1 and alone > 1  # a batch of one: --alone-prompts prompts, one at a time
        rates, rounds, stalls = interleaved_rates({system: engine},
                                                  prompts[:alone if solo else bs], params,
                                                  spec["repeats"], watch, alone=solo)
        info = engine.get_server_info().get("speculative") or {}
        out["batches"][str(bs)] = {
            "alone_prompts": alone if bs == 1 else None,
            "digests_per_round": [[common.output_digest(o["output_ids"]) for o in r]
                                  for r in rounds[system]],
            "rates": rates[system], "stalls_per_round": stalls[system],
            "plain_decode_tokens_per_round": [plain_tokens(o) for o in rounds[system]],
            "switches_by_why": dict(switch_counts(engine) - before),
            "adaptive_buckets": info.get("adaptive"), "chain_depth": common.chain_depth(engine)}
    engine.shutdown()
    return out


def run_passes(args, label: str, draft, run=common.run_json_worker, keep=None) -> dict:
    """{system: [each pass's worker result]}, every system once a pass, in --systems order
    on even passes and the reverse on odd ones. keep: given each worker's result as a line
    (`WORKER_BENCH`) as soon as it ends, so a run stopped by a time limit keeps the workers
    that finished (the cells need every pass: before, a run cut in its last worker kept
    nothing of the seven before it)."""
    names = systems_of(args)
    results = {s: [] for s in names}
    for k in range(args.passes):
        for name in names if k % 2 == 0 else names[::-1]:
            system, _, tree = name.partition("@")
            spec = {"system": system, "algorithm": label.split()[0], "draft": draft,
                    "model_path": args.model_path, "device": args.device,
                    "batches": args.batches, "setting": list(common.parse_setting(args.setting)),
                    "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                    "prompt_len": args.prompt_len, "alone_prompts": args.alone_prompts}
            code = _tree(args)[1] if tree else None
            script = Path(code or Path(__file__).resolve().parents[1], "benchmarks", SCRIPT)
            more = {"code": code} if code else {}  # the other checkout's worker, on its path
            results[name].append(run(str(script), "--worker", spec, **more))
            if keep is not None:
                keep({"bench": WORKER_BENCH, "algorithm": label, "pass": k, **spec,
                      "system": name, **results[name][-1]})
            rates = {bs: round(common.median(c["rates"])) for bs, c in
                     results[name][-1]["batches"].items()}
            print(f"[bench_alone] {label} pass {k} {name}: tok/s by batch {rates}", flush=True)
    return results


def _machine(results: dict, system: str) -> dict:
    """The machine a system's last worker ran on; a system from another checkout (SYSTEM@NAME)
    keeps that checkout's commit as tree_git and takes no-spec's as git: its lines belong to
    this run (bench_adaptive's tables leave out lines of another run)."""
    machine = dict(results[system][-1]["machine"])
    if "@" in system:
        machine["tree_git"] = machine.pop("git", None)
        machine["git"] = results["no-spec"][-1]["machine"].get("git")
    return machine


def systems_of(args) -> list:
    """--systems, then with --tree NAME=DIR each of --tree-systems run from the checkout at
    DIR, named SYSTEM@NAME: two commits' engines side by side, alternating alike."""
    name, _ = _tree(args)
    if name is None:
        return list(args.systems)
    return list(args.systems) + [f"{s}@{name}" for s in args.tree_systems or args.systems[1:]]


def _tree(args) -> tuple:
    """(NAME, DIR) of --tree NAME=DIR, DIR made absolute, or (None, None). NOTE: a relative DIR
    was read again from inside the other checkout, where its worker runs, and not found."""
    tree = getattr(args, "tree", None)
    if not tree:
        return None, None
    name, _, code = tree.partition("=")
    return name, str(Path(code).resolve())


def texts_as(results: dict, system: str, bs: str):
    """[outputs the same text as no-spec's for the same prompt, outputs] over a system's timed
    batches of size bs, or None where a worker did not name its outputs (another checkout's).
    Tokens per second compare like for like only over the same texts: in bf16 a near tie can
    turn a speculative step's token from a plain step's (a batch of one's chat prompt, on an
    H100, at its 9th token), and NGRAM accepts more on one answer than on another."""
    cells = [res["batches"][bs] for res in results[system]]
    base = results["no-spec"][0]["batches"][bs].get("digests_per_round")
    if not base or any("digests_per_round" not in c for c in cells):
        return None
    rounds = [r for c in cells for r in c["digests_per_round"]]
    same = sum(d == b for r in rounds for d, b in zip(r, base[0]))
    return [same, sum(len(r) for r in rounds)]


def lines_of(args, label: str, draft, results: dict) -> list:
    """bench_adaptive's lines from run_passes' results: rates over every pass."""
    lines = []
    for bs in map(str, args.batches):
        base_rates = [r for res in results["no-spec"] for r in res["batches"][bs]["rates"]]
        base = common.median(base_rates)
        for system in systems_of(args)[1:]:
            cells = [res["batches"][bs] for res in results[system]]
            rates = [r for c in cells for r in c["rates"]]
            lines.append({
                "bench": BENCH, "model": args.model_path or "default", "algorithm": label,
                "system": system, "setting": list(common.parse_setting(args.setting)),
                "batch": int(bs), "max_new_tokens": args.max_new_tokens,
                "tok_s": common.median(rates), "repeats": args.repeats,
                "passes": args.passes, "interleaved": False,
                "rates": [round(x, 1) for x in rates],
                "no_spec_rates": [round(x, 1) for x in base_rates], "no_spec_tok_s": base,
                "speedup": common.median(rates) / base,
                "plain_decode_tokens_per_round": [p for c in cells
                                                  for p in c["plain_decode_tokens_per_round"]],
                "stalls_per_round": [s for c in cells for s in c["stalls_per_round"]],
                "switches_by_why": [c["switches_by_why"] for c in cells],
                "adaptive_buckets": cells[-1]["adaptive_buckets"], "draft": draft,
                "chain_depth": cells[-1]["chain_depth"],
                "alone_prompts": cells[-1].get("alone_prompts"),
                "texts_as_no_spec": texts_as(results, system, bs),
                **_machine(results, system)})
            print(f"[bench_alone] {label:8} {system:8} bs {bs:>3} {lines[-1]['tok_s']:9.1f} "
                  f"tok/s  {lines[-1]['speedup']:.2f}x no-spec, texts as no-spec's "
                  f"{lines[-1]['texts_as_no_spec']}", flush=True)
    return lines


def run_all(args) -> None:
    from bench_adaptive import drafts_of

    if args.systems[0] != "no-spec":
        raise SystemExit(f"--systems must start with no-spec (the baseline), got {args.systems}")
    code = _tree(args)[1]
    if code is not None and not Path(code, "benchmarks", SCRIPT).is_file():
        raise SystemExit(f"--tree {args.tree}: no benchmarks/{SCRIPT} in {code}")
    for label, draft in drafts_of(args).items():
        results = run_passes(args, label, draft,
                             keep=lambda line: common.append_jsonl(args.out, [line]))
        common.append_jsonl(args.out, lines_of(args, label, draft, results))


def main(argv=None) -> None:
    from bench_adaptive import add_run_args, render_plot, render_table

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(json.loads(argv[1]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, "adaptive_alone.jsonl")
    p.add_argument("--passes", type=int, default=2,
                   help="workers per system, the order reversed every other pass")
    p.add_argument("--alone-prompts", type=int, default=1, metavar="N",
                   help="a batch of one: N prompts one after another, each alone (one "
                        "prompt's answer can favour a draft or not)")
    p.add_argument("--tree", default=None, metavar="NAME=DIR",
                   help="also run --tree-systems from the checkout at DIR (SYSTEM@NAME)")
    p.add_argument("--tree-systems", nargs="*", default=[], metavar="SYSTEM",
                   help="with --tree: these systems there (default: --systems but no-spec)")
    common.measure_or_render(p, argv, run_all, partial(render_table, bench=BENCH),
                             partial(render_plot, bench=BENCH))


if __name__ == "__main__":
    main()
