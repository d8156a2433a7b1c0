"""Host time of a decode step, on any machine. The engine's decode graphs are stood in for by
replays that do nothing, so what a step costs is the host's work alone: scheduling, building the
batch, its copies and attention metadata, sampling, the read of its tokens, stop checks. On a
GPU that work decides a small model's step (the default model's batch-1 step: 635 us of kernels
in 961 us, H100, e5e965b); this probe measures it without one.

On CPU a copy is a memcpy, not a launch, so the figures are a floor for the launches' share;
Python's share is what a GPU's host runs. A tiny random Llama (2 layers, 128-token vocabulary)
keeps the prefills and the one capture-time forward short: a no-op replay makes the model's
size irrelevant to a step.

    python benchmarks/probe_host_step.py [--batches 1 8 64] [--steps 192] [--repeats 5]
        [--draft held|adaptive|ngram-held|eagle3-held|eagle3-copied|eagle3-adaptive ...]
        [--profile N] [--out benchmarks/results/host_step.jsonl]

Per batch size: `steps` new tokens per request (EOS ignored) with every request decoding from
the first step on; a step's host time is the median time between two of the scheduler's
overlapped decode calls. Median (and range) over the repeats. With --draft a second engine with
a STANDALONE draft (the tiny model itself), held to plain steps or left to choose them, takes
turns with the first, a repeat each: what a plain step costs the host in an engine that could
speculate, and what its adaptive controller adds. ngram-held: an NGRAM engine held to plain
steps, whose every step also runs the shadow verifies that price its speculation. eagle3-held:
an EAGLE3 engine held to plain steps, whose graphs write the head's hidden rows to its ring
(specpcg/hidden_ring.py); eagle3-copied: the same with the ring off, the rows copied out after
each step; eagle3-adaptive: left to choose (its eager speculative steps lose on CPU: plain steps
but for its looks). Several --draft engines take their turns together.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # the capture-time forward and the prefills

import torch  # noqa: E402

import common  # noqa: E402

common.add_repo_to_path()

DRAFTED = {"held": "STANDALONE held to plain steps", "adaptive": "STANDALONE, adaptive",
           "ngram-held": "NGRAM held to plain steps",
           "eagle3-held": "EAGLE3 (random head) held to plain steps",
           "eagle3-copied": "EAGLE3 (random head) held to plain steps, rows copied out",
           "eagle3-adaptive": "EAGLE3 (random head), adaptive"}
EAGLE3 = ("eagle3-held", "eagle3-copied", "eagle3-adaptive")
HELD = ("held", "ngram-held", "eagle3-held", "eagle3-copied")


class _NoReplay:
    def replay(self) -> None:
        pass


def _capture_once(body, pool):
    """The body runs once, for its outputs' buffers (a step then reads what it left there)."""
    return _NoReplay(), body()


def stub_cuda_timing() -> None:
    """What a capture times and measures on CUDA, made no-ops on CPU."""
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.memory_allocated = lambda *a: 0


def graph_engine(path: str, max_bs: int, draft: str = None):
    """A CPU engine whose DECODE steps replay graphs that do nothing; with `draft`, one with a
    STANDALONE draft (the model itself) whose adaptive controller is held to plain steps
    ("held"), or left to choose ("adaptive": its speculative steps run eagerly on CPU, so after
    its warm-up it decodes plain, but for its looks); "ngram-held": NGRAM held to plain
    steps."""
    import specpcg.graphs.decode_runner as decode_runner
    from specpcg import Engine
    from specpcg.core import CaptureHiddenMode
    from specpcg.graphs.buckets import decode_batch_buckets

    decode_runner.warm_and_capture = _capture_once
    stub_cuda_timing()
    from bench_adaptive import engine_kwargs

    if draft == "ngram-held":  # its plain steps feed shadow verifies (speculative/shadow.py)
        spec = engine_kwargs("adaptive", "NGRAM", None, (7, 1, 8))
    elif draft in EAGLE3:  # its plain steps capture three layers' hidden states
        from bench_step import random_head_dir

        spec = engine_kwargs("adaptive", "EAGLE3", random_head_dir("EAGLE3", path), (7, 1, 8))
    else:
        spec = engine_kwargs("adaptive" if draft else "no-spec", "STANDALONE", path, (3, 1, 4))
    ring = {"SPECPCG_HIDDEN_RING": "0" if draft == "eagle3-copied" else "1"}
    with mock.patch.dict(os.environ, ring):
        engine = Engine(model_path=path, skip_tokenizer_init=True, device="cpu", dtype="float32",
                        attention_backend="triton", max_total_tokens=max_bs * 512,
                        max_running_requests=max_bs, **spec)
    if draft in HELD:
        from holds import plain_only

        plain_only(engine)
    # The hidden states a plain step captures for the draft, as the engine's graphs would.
    head = engine.draft if draft in EAGLE3 else None
    hidden = (head.needs_hidden, tuple(head.aux_layers)) if head else (CaptureHiddenMode.NULL, ())
    kw = dict(show_progress=False)
    try:
        runner = decode_runner.DecodeGraphRunner(engine.runner, decode_batch_buckets(max_bs),
                                                 *hidden, None, write_rows=True, **kw)
    except TypeError:  # a tree before the runner wrote req_to_token itself
        runner = decode_runner.DecodeGraphRunner(engine.runner, decode_batch_buckets(max_bs),
                                                 *hidden, None, **kw)
    runner.capture()
    engine.router.runners["decode_graph"] = runner
    return engine


def call_gaps(engine, method: str, batch: int, new_tokens: int, repeats: int,
              check) -> list:
    """Per repeat, after a warm-up generate: the seconds between successive calls of
    `Scheduler.<method>` while `batch` requests generate `new_tokens` tokens each (EOS
    ignored). check(calls, outputs) raises where a run's call count (its outputs: the timed
    generate's) shows steps that took another path."""
    from specpcg.scheduler import Scheduler

    stamps = []
    real = getattr(Scheduler, method)

    def stamped(self):
        stamps.append(time.perf_counter())
        return real(self)

    setattr(Scheduler, method, stamped)
    prompts = [[(7 * i + j) % 100 + 3 for j in range(12 + i % 5)] for i in range(batch)]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    runs = []
    try:
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        for _ in range(repeats):
            stamps.clear()
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
            check(len(stamps), outputs)
            runs.append([b - a for a, b in zip(stamps, stamps[1:])])
    finally:
        setattr(Scheduler, method, real)
    return runs


def step_stats(runs: list) -> tuple:
    """Over the repeats' call gaps (call_gaps' runs): the median, min and max of a run's
    median time between two decode calls of the scheduler (each launches a step and reads the
    one before: one step of host work), the median of a run's mean (what throughput sees: rare
    slow steps count), and the slowest step; microseconds."""
    medians = [common.median(g) * 1e6 for g in runs]
    return (common.median(medians), min(medians), max(medians),
            common.median(sum(g) / len(g) * 1e6 for g in runs), max(max(g) for g in runs) * 1e6)


def runs_in_turn(engines: dict, batch: int, steps: int, repeats: int) -> dict:
    """{name: call_gaps' runs}: the engines take turns a repeat at a time, so the machine's
    drift lands on each alike."""
    def check(calls: int, outputs: list) -> None:
        # An adaptive engine's looks speculate: their tokens come from no overlapped call.
        plain = min(o["meta_info"].get("plain_decode_tokens", steps) for o in outputs)
        assert calls >= (plain or steps) - 1, f"{calls} overlapped decode calls"

    runs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name] += call_gaps(engine, "_run_overlapped", batch, steps, 1, check)
    return runs


def main(argv=None) -> list:
    from tests.tiny_models import save_tiny_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=192,
                   help="new tokens per request (the tiny model holds 256 positions)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draft", choices=tuple(DRAFTED), nargs="+", default=[],
                   help="beside it, engines with a draft held to plain steps or not")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then one more batch of the largest size per engine under cProfile: "
                        "its N engine functions of most cumulative time")
    p.add_argument("--out", default=None, help="append a JSON line per batch size here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        # An EAGLE3 head reads three distinct layers of its target.
        save_tiny_checkpoint("llama", path,
                             num_layers=4 if set(args.draft) & set(EAGLE3) else 2)
        engines = {"no-spec": graph_engine(path, max(args.batches))}
        for draft in args.draft:
            engines[DRAFTED[draft]] = graph_engine(path, max(args.batches), draft)
        records = []
        for bs in args.batches:
            runs = runs_in_turn(engines, bs, args.steps, args.repeats)
            for name, engine in engines.items():
                records.append(_record(name, engine, bs, step_stats(runs[name]), args))
        for name, engine in engines.items() if args.profile else ():
            print(f"\n{name}, batch {max(args.batches)} under cProfile:", end="")
            profiled(engine, max(args.batches), args.steps, args.profile)
    if args.out:
        common.append_jsonl(args.out, records)
    return records


def profiled(engine, batch: int, steps: int, top: int) -> None:
    """One batch under cProfile: the engine's `top` functions by self time, then by
    cumulative time."""
    from profiling import print_rows, profile_rows

    prompts = [[(7 * i + j) % 100 + 3 for j in range(12 + i % 5)] for i in range(batch)]
    params = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
    for sort in ("tottime", "cumtime"):
        rows = profile_rows(lambda: engine.generate(input_ids=prompts, sampling_params=params),
                            top, sort)
        print_rows(f"by {sort}:", rows)


def _record(name: str, engine, bs: int, stats: tuple, args) -> dict:
    med, lo, hi, mean, worst = stats
    served = {s["runner"] for s in engine.router.forward_stats() if s["mode"] == "DECODE"}
    assert served == {"decode_graph"}, f"DECODE steps ran on {served}"
    print(f"{name}: batch {bs:3d}: {med:7.1f} us a step (host), range {lo:.1f}-{hi:.1f}; "
          f"mean {mean:.1f}, slowest step {worst:.0f}")
    return {"bench": "host_step", "engine": name, "batch_size": bs, "host_us_per_step": med,
            "min_us": lo, "max_us": hi, "mean_us": mean, "slowest_step_us": worst,
            "steps": args.steps, "repeats": args.repeats, **common.machine_info(engine.device),
            "time": common.now_iso()}


if __name__ == "__main__":
    main()
