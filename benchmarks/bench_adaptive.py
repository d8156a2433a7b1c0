"""Adaptive speculation against no-spec and against speculating at every step, per batch size.

For each algorithm (NGRAM, every --drafts ALGO=DIR, every --untrained ALGO: a draft that
predicts badly, where speculating never pays) at each --batches size, engines alive side by
side decode the same greedy prompts, their timed batches taking turns: no-spec, speculative at
every step (pinned), adaptive (the engine's default) and, with --systems, the extra ones
below. Lines carry tok/s, the speedup over no-spec, and how many steps the adaptive engine
ran on each side. The goal: adaptive >= 1.0x no-spec at every size.

Prompts: held-out ShareGPT first turns through the chat template on a model with a tokenizer;
on a random-weight shape (`shape:llama-3-8b`) repeated-id prompts, over which NGRAM finds
matches that the random target rarely follows (speculation that does not pay).

    python benchmarks/bench_adaptive.py [--model-path shape:llama-3-8b] [--drafts EAGLE3=DIR]
        [--untrained EAGLE EAGLE3 NEXTN STANDALONE] [--systems no-spec pinned plain adaptive]
        [--batches 1 4 16 64] [--setting 7,1,8] [--repeats 3] [--out FILE]
    python benchmarks/bench_adaptive.py --table-only benchmarks/results/adaptive.jsonl
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import common
from holds import HOLDS
from stalls import StallWatch

common.add_repo_to_path()

SYSTEMS = ("no-spec", "pinned", "adaptive")
# --systems may add "adaptive-rate": the adaptive controller comparing per-request rates alone,
# without the finish estimate of a batch with nothing waiting (`Finish`), to measure what that
# estimate gains or costs; and "plain": the engine with its draft, held to plain steps, whose
# speed is the floor adaptive speculation stands on where speculating does not pay (what a
# plain step costs in an engine with a draft: the hidden states a head catches up on); and
# "adaptive-finish8": with NGRAM's shadow verifies, the finish estimate over each request's last
# 8 of them instead of rates alone (`finish_recent8`); and "adaptive-whole-budget": every look
# gets all of LOOK_BUDGET, however far behind the other side is (`whole_budget`); and
# "adaptive-cap63": adaptive with speculative_disable_by_batch_size=63 (batches of 64 and more
# decode plain, as SGLang turns speculation off at batch >= 64); and "adaptive-untold": not
# told the draft's lag (`untold_lag`); and "adaptive-symmetric": into speculation only where it
# is SWITCH_MARGIN faster, as out of it (`symmetric`); and "adaptive-unflushed": the step a
# switch flushes left uncounted (`unflushed`); and "adaptive-min16": the finish estimate's
# priors from 16 finished requests on (`min16`); and "pinned-eager-prompts" and
# "adaptive-eager-prompts": without the prompt runner, a new prompt's catch-up one eager
# forward where the look runners do not reach (`eager_prompts`); and "adaptive-unplaced": a
# batch of one measured as any other batch, blind to where in its answer the request is
# (`unplaced`); and "adaptive-shadow-rates": NGRAM's shadow verifies priced on rates alone, also
# with nothing waiting (`shadow_rates`); and "adaptive-shadow-relook": a bucket with them looks
# at a side it holds fewer than 8 steps of as other buckets do (`shadow_relook`); and
# "adaptive-lean": a look's wait and the finish estimate priced seldom (`lean`); and
# "adaptive-then-plain": plain steps without asking once a size's untimed batch ran (`then_plain`).
EXTRA_SYSTEMS = ("adaptive-rate", "plain", "adaptive-finish8", "adaptive-whole-budget",
                 "adaptive-cap63", "adaptive-untold", "adaptive-symmetric", "adaptive-unflushed",
                 "adaptive-min16", "pinned-eager-prompts", "adaptive-eager-prompts",
                 "adaptive-unplaced", "adaptive-shadow-rates",
                 "adaptive-shadow-relook", "adaptive-lean", "adaptive-then-plain")
CAP = 63


# Prompts are the first of one pool of at least this many, whatever the largest batch of a run.
# NOTE: drawn for each run's largest batch, a batch of 1 ran another prompt in every run, and
# its cells differed by more than any change measured: the default command's STANDALONE draft
# ran pinned at 1.18-1.24x no-spec up to batch 64 (d14091e), 0.97x up to batch 4 (611c80f), and
# about 1.25x as the only batch (probe_adaptive_steps, 611c80f; one H200).
PROMPT_POOL = 64


def prompts_for(engine, num: int, prompt_len: int) -> list:
    """`num` prompts as token ids (the first of PROMPT_POOL or more): held-out chat turns, or
    repeated ids without a tokenizer."""
    pool = max(num, PROMPT_POOL)
    if engine.tokenizer is not None:
        from drafts.data import heldout_samples
        from drafts.distill import first_prompts

        return first_prompts(heldout_samples("sharegpt", 4 * pool), engine.tokenizer, pool)[:num]
    from accept_prompts import repeated_id_prompts

    return repeated_id_prompts(num, prompt_len, 16, engine.model_config.vocab_size)


def interleaved_rates(engines: dict, prompts: list, params: dict, repeats: int,
                      watch=None, alone: bool = False) -> tuple:
    """({system: tok/s of each of `repeats` timed batches}, {system: each timed batch's
    outputs, in the same order}, {system: what `watch` (a stalls.StallWatch) counted in each}).

    Every engine first runs one untimed batch of the same size (a long-lived engine's steady
    state, its adaptive choices already measured: one batch of 128 tokens at batch 1 lasts a
    fifth of a second on a GPU, too short alone). Then the timed batches take turns, one per
    engine per round, the order rotated each round: engines measured one after the other
    drifted apart with the device (engines held to plain steps measured 0.95-1.02x of a
    no-spec run minutes earlier; two H200 runs of one tree differed by up to 0.17x in a cell).

    alone: a batch is its prompts one after another, each running alone (timed together)."""
    def generate(engine):
        if not alone:
            return engine.generate(input_ids=prompts, sampling_params=params)
        return [out for p in prompts for out in engine.generate(input_ids=[p],
                                                                 sampling_params=params)]

    for engine in engines.values():
        generate(engine)
    names = list(engines)
    rates, outs, stalls = ({s: [] for s in engines} for _ in range(3))
    for r in range(repeats):
        for system in names[r % len(names):] + names[:r % len(names)]:
            before = watch.counts() if watch is not None else None
            t0 = time.perf_counter()
            out = generate(engines[system])
            dt = time.perf_counter() - t0
            outs[system].append(out)
            rates[system].append(sum(o["meta_info"]["completion_tokens"] for o in out) / dt)
            stalls[system].append(watch.since(before) if watch is not None else {})
    return rates, outs, stalls


def plain_tokens(outputs: list) -> int:
    """Tokens a batch's requests got from plain decode steps (the rest came from verifies)."""
    return sum(o["meta_info"].get("plain_decode_tokens", 0) for o in outputs)


def engine_kwargs(system: str, algo: str, draft, setting: tuple) -> dict:
    if system == "no-spec":
        return {}
    steps, topk, tokens = setting
    return dict(speculative_algorithm=algo, speculative_draft_model_path=draft,
                speculative_num_steps=steps, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=tokens,
                disable_adaptive_speculation=system.startswith("pinned"),
                speculative_disable_by_batch_size=CAP if system == "adaptive-cap63" else None)


def switch_counts(engine) -> Counter:
    """The adaptive controller's switches of side so far by what chose them (empty without
    adaptive speculation)."""
    adaptive = engine.scheduler.adaptive
    return adaptive.switches() if adaptive is not None else Counter()


def untrained_drafts(algos: list, model_path) -> dict:
    """Drafts that predict badly, where speculation must not cost speed: random heads of the
    model's shape, and for STANDALONE the model's first STANDALONE_LAYERS layers, untrained."""
    import tempfile

    from bench_step import random_head_dir
    from drafts.truncate import truncate
    from specpcg.models.loader import default_model_path

    out = {}
    for algo in algos:
        if algo == "STANDALONE":
            out[algo] = tempfile.mkdtemp(prefix="truncated-")
            truncate(model_path or default_model_path(), STANDALONE_LAYERS, out[algo])
        else:
            out[algo] = random_head_dir(algo, model_path or default_model_path())
    return out


def add_probe_args(p) -> None:
    """Options of a probe that runs one engine with a draft (probe_jit.py, probe_switch.py)."""
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--draft", default=None)
    p.add_argument("--untrained", action="store_true", help="a random head (bench_adaptive's)")
    p.add_argument("--setting", default="3,1,4")


def probe_engine(args, system: str, most: int):
    """(engine, draft) for add_probe_args' options: `system`'s engine (engine_kwargs) sized for
    batches of up to `most` requests, with an untrained draft where --untrained asks."""
    from specpcg import Engine

    draft = args.draft
    if args.untrained:
        draft = untrained_drafts([args.algorithm], args.model_path)[args.algorithm]
    engine = Engine(model_path=args.model_path, show_progress=False, max_running_requests=most,
                    cuda_graph_max_bs=most, **engine_kwargs(system, args.algorithm, draft,
                                                            common.parse_setting(args.setting)))
    return engine, draft


STANDALONE_LAYERS = 4
UNTRAINED = "(untrained)"  # after the algorithm's name in a line's "algorithm"


def build_engines(args, algo: str, draft, setting: tuple) -> dict:
    """One engine per system, all alive at once (interleaved_rates). Engine k of n sizes its
    weights and KV from 0.8 / (n - k) of the memory still free on a GPU, so each gets a like
    share."""
    from specpcg import Engine

    most, engines = max(args.batches), {}
    for k, system in enumerate(args.systems):
        engine = Engine(model_path=args.model_path, device=args.device,
                        max_running_requests=most, cuda_graph_max_bs=most, show_progress=False,
                        mem_fraction_static=0.8 / (len(args.systems) - k),
                        **engine_kwargs(system, algo, draft, setting))
        if system in HOLDS:
            HOLDS[system](engine)
        engines[system] = engine
    return engines


def drafts_of(args) -> dict:
    """{label: draft path (None: NGRAM's)}: NGRAM unless --skip-ngram, --drafts, --untrained."""
    drafts = {} if args.skip_ngram else {"NGRAM": None}
    drafts.update(item.split("=", 1) for item in args.drafts)
    untrained = untrained_drafts(args.untrained, args.model_path)
    drafts.update({f"{algo} {UNTRAINED}": path for algo, path in untrained.items()})
    return drafts


def run_all(args) -> None:
    if args.systems[0] != "no-spec":
        raise SystemExit(f"--systems must start with no-spec (the baseline), got {args.systems}")
    drafts = drafts_of(args)
    setting = common.parse_setting(args.setting)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = watch = None
    for label, draft in drafts.items():
        algo, lines = label.split()[0], []
        engines = build_engines(args, algo, draft, setting)
        watch = watch or StallWatch(engines["no-spec"].device)
        prompts = prompts or prompts_for(engines["no-spec"], max(args.batches), args.prompt_len)
        for bs in args.batches:
            before = {s: switch_counts(e) for s, e in engines.items()}
            rates, rounds, stalls = interleaved_rates(engines, prompts[:bs], params,
                                                      args.repeats, watch)
            base = common.median(rates["no-spec"])
            for system in args.systems[1:]:
                rate, engine = common.median(rates[system]), engines[system]
                adaptive = engine.get_server_info()["speculative"]["adaptive"]
                lines.append({
                    "bench": "adaptive", "model": args.model_path or "default",
                    "algorithm": label, "system": system, "setting": list(setting),
                    "batch": bs, "max_new_tokens": args.max_new_tokens, "tok_s": rate,
                    "repeats": args.repeats, "interleaved": True,
                    "rates": [round(x, 1) for x in rates[system]],
                    "no_spec_rates": [round(x, 1) for x in rates["no-spec"]],
                    "no_spec_tok_s": base, "speedup": rate / base,
                    # Each timed batch's, beside its rate: a round that looked at the other
                    # side shows it (lines before this field kept only the last round's).
                    "plain_decode_tokens_per_round": [plain_tokens(out) for out in rounds[system]],
                    "plain_decode_tokens": plain_tokens(rounds[system][-1]),
                    # what can stall a round (stalls.StallWatch), each timed batch's, in order
                    "stalls_per_round": stalls[system],
                    "no_spec_stalls_per_round": stalls["no-spec"],
                    "adaptive_buckets": adaptive, "draft": draft,
                    # this size's rounds (the untimed one included): switches of side by what
                    # chose them (switches.SWITCH_WHY), every bucket the batches shrank through
                    "switches_by_why": dict(switch_counts(engine) - before[system]),
                    "chain_depth": common.chain_depth(engine),
                    **common.machine_info(engine.device)})
                print(f"[bench_adaptive] {label:8} {system:8} bs {bs:3} "
                      f"{rate:9.1f} tok/s  {lines[-1]['speedup']:.2f}x no-spec", flush=True)
        for engine in engines.values():
            engine.shutdown()
        common.append_jsonl(args.out, lines)


def _latest(records: list, bench: str = "adaptive") -> dict:
    """(model, algorithm, batch) -> {system: its latest line of `bench`}."""
    table, _ = common.latest_by(records, bench,
                                lambda r: (r["model"], r["algorithm"], r["batch"]))
    # Systems of an older run (another commit) than the cell's adaptive line are left out:
    # beside it they would compare two engines, settings or drafts as if one run.
    for row in table.values():
        run = row.get("adaptive", {}).get("git")
        for system in [s for s in row if run and row[s].get("git") != run]:
            del row[system]
    return table


def _systems(table: dict) -> list:
    """The systems other than no-spec that the lines hold, in SYSTEMS order, each followed by
    its runs from other checkouts (bench_alone's SYSTEM@NAME)."""
    present = {s for row in table.values() for s in row}
    order = list(SYSTEMS[1:] + EXTRA_SYSTEMS)
    return sorted((s for s in present if s.split("@")[0] in order),
                  key=lambda s: (order.index(s.split("@")[0]), s))


def render_table(records: list, bench: str = "adaptive") -> str:
    table = _latest(records, bench)
    keys = sorted({k[:2] for k in table})
    columns = [("model", lambda k: k[0]), ("algorithm", lambda k: k[1])]
    for system in _systems(table):
        for bs in sorted({k[2] for k in table}):
            columns.append((f"{system} bs {bs}", lambda k, s=system, b=bs: (
                table.get((*k, b), {}).get(s, {}).get("speedup"))))
    return common.column_table(keys, columns)


def render_plot(records: list, path, bench: str = "adaptive") -> None:
    table = _latest(records, bench)
    panels = []
    for model, algo in sorted({k[:2] for k in table}):
        series = {s: [(k[2], table[k][s]["speedup"]) for k in sorted(table)
                      if k[:2] == (model, algo) and s in table[k]] for s in _systems(table)}
        panels.append({"title": f"{algo} on {model}", "xlabel": "batch size",
                       "ylabel": "speedup over no-spec", "logx": True, "logy": False,
                       "series": series})
    common.line_plot(panels, path, "Adaptive vs pinned speculation (1.0 = no-spec)")


def add_run_args(p, out: str) -> None:
    """The options of a run (this bench's, bench_alone.py's); results go to `out`."""
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--drafts", nargs="*", default=[], metavar="ALGO=DIR")
    p.add_argument("--skip-ngram", action="store_true", help="only the drafts named")
    p.add_argument("--untrained", nargs="*", default=[],
                   choices=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE"),
                   help="also these algorithms with untrained drafts (random heads; STANDALONE: "
                        "the model's first layers)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                   choices=SYSTEMS + EXTRA_SYSTEMS, help="no-spec must come first")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--setting", default="7,1,8", help="steps,topk,draft tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="repeated-id prompts' length")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per cell (median)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / out))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, "adaptive.jsonl")
    common.measure_or_render(p, argv, run_all, render_table, render_plot)


if __name__ == "__main__":
    main()
