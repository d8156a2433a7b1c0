"""Host time of an overlapped speculative step, on any machine: probe_host_step's measure for
NGRAM's steps. The step graphs are stood in for by replays that do nothing, and the step's
results buffer says every request accepted every draft (synthetic p = 1: each step emits
`--tokens` tokens a request), so what a step costs is the host's work alone: the checks before
a step, its KV reservations, the rows, the replay call, the one read of the step before, and
for each request its record, its tokens and its stop checks.

On CPU a copy is a memcpy, not a launch, so the figures are a floor for the launches' share;
Python's share is what a GPU's host runs. A tiny random Llama (2 layers) keeps prefills and the
capture-time bodies short.

    python benchmarks/probe_spec_host.py [--batches 1 16 64] [--steps 24] [--repeats 5]
        [--tokens 8] [--adaptive] [--out benchmarks/results/spec_host_step.jsonl]

Per batch size: the median time between two of the scheduler's overlapped speculative calls
(each queues a step and reads the one before), median (and range) over the repeats.

With --adaptive the engine runs adaptive speculation's host work as well: NGRAM's shadow
verifies after every step and the controller's choice before it (which is then overridden:
every step still speculates, so the same steps are timed with and without that work).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # the capture-time bodies and the prefills

import torch  # noqa: E402

import common  # noqa: E402
from probe_host_step import _capture_once, call_gaps, stub_cuda_timing  # noqa: E402

common.add_repo_to_path()

POSITIONS = 256  # the tiny model's context


def spec_engine(path: str, max_bs: int, tokens: int, adaptive: bool = False):
    """A CPU engine whose overlapped NGRAM steps replay graphs that do nothing; with
    `adaptive`, adaptive speculation's host work too (shadow verifies, the controller's
    choice), every step still speculative."""
    import specpcg.speculative.step_graph as step_graph
    from specpcg import Engine
    from specpcg.graphs.buckets import decode_batch_buckets

    step_graph.warm_and_capture = _capture_once
    stub_cuda_timing()
    engine = Engine(model_path=path, skip_tokenizer_init=True, device="cpu", dtype="float32",
                    attention_backend="triton", max_total_tokens=max_bs * POSITIONS,
                    max_running_requests=max_bs, speculative_algorithm="NGRAM",
                    speculative_num_steps=tokens - 1, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=tokens, disable_adaptive_speculation=not adaptive,
                    show_progress=False)
    if adaptive:  # its choice made, then speculation whatever it chose: every step timed
        choose = engine.scheduler.adaptive.use_spec
        engine.scheduler.adaptive.use_spec = lambda *a, **k: choose(*a, **k) or True
    overlap = engine.scheduler.spec_overlap
    if overlap is None:
        raise RuntimeError("this engine's speculative steps do not overlap")
    # The buckets a GPU engine's decode graphs give its step graphs (a CPU engine has one).
    decode = SimpleNamespace(buckets=decode_batch_buckets(max_bs))
    graphs = overlap.graphs = step_graph.SpecStepGraphs(
        overlap.dec, engine.runner, engine.draft.step_round(decode, max_bs), None, False)
    graphs.capture()
    # Each row: all w - 1 drafts accepted, nodes 3, 4, ... in path order (the root, 3, is not
    # emitted), bonus 3, the nodes' order unchanged.
    for out in graphs.state.out.values():
        w = (out.shape[1] - 2) // 2
        out[:, 0] = w - 1
        out[:, 1] = 3
        out[:, 2:2 + w] = torch.arange(w) + 3
        out[:, 2 + w:] = torch.arange(w)
    return engine


def step_us(engine, batch: int, steps: int, repeats: int, tokens: int) -> tuple:
    """Over the repeats: the median, min and max of a run's median time between two
    overlapped speculative calls, and the median of a run's mean."""
    def check(calls: int, outputs: list) -> None:
        if calls != steps + 1:  # each call queues a step, and one more reads the last
            raise RuntimeError(f"{calls} overlapped speculative calls for {steps} steps: some "
                               "steps did not overlap")

    runs = call_gaps(engine, "_run_spec_overlapped", batch, steps * tokens, repeats, check)
    medians = [common.median(g) * 1e6 for g in runs]
    return (common.median(medians), min(medians), max(medians),
            common.median(sum(g) / len(g) * 1e6 for g in runs))


def main(argv=None) -> list:
    from tests.tiny_models import save_tiny_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=24, help="steps a request runs")
    p.add_argument("--tokens", type=int, default=8, help="nodes a step verifies (all accepted)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--adaptive", action="store_true",
                   help="adaptive speculation on: what its shadow verifies and choice add")
    p.add_argument("--out", default=None, help="append a JSON line per batch size here")
    args = p.parse_args(argv)
    if (args.steps + 2) * args.tokens + 40 > POSITIONS:
        p.error(f"--steps {args.steps} of --tokens {args.tokens} pass the tiny model's "
                f"{POSITIONS} positions")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        save_tiny_checkpoint("llama", path)
        engine = spec_engine(path, max(args.batches), args.tokens, args.adaptive)
        records = []
        for bs in args.batches:
            med, lo, hi, mean = step_us(engine, bs, args.steps, args.repeats, args.tokens)
            print(f"batch {bs:3d}: {med:7.1f} us a speculative step (host), range "
                  f"{lo:.1f}-{hi:.1f}; mean {mean:.1f}", flush=True)
            records.append({"bench": "spec_host_step", "algorithm": "NGRAM",
                            "adaptive": args.adaptive,
                            "batch_size": bs, "tokens_per_step": args.tokens,
                            "host_us_per_step": med, "min_us": lo, "max_us": hi,
                            "mean_us": mean, "steps": args.steps, "repeats": args.repeats,
                            **common.machine_info(engine.device), "time": common.now_iso()})
    if args.out:
        common.append_jsonl(args.out, records)
    return records


if __name__ == "__main__":
    main()
