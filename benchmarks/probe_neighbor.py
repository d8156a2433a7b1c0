"""What building a second engine in the process does to the first one's decode steps.

A no-spec engine decodes a batch (--batch requests, --max-new-tokens each, EOS ignored) for
--rounds timed rounds; then a second engine is built (--second: no-spec, or pinned / adaptive
speculation with --algorithm and --draft), and the first engine's rounds run again; with
--close, the second engine is closed and they run a third time. Per round: tokens per second,
and, around every call of the decode graph runner's forward (the graph replay and the logits
it returns), the host's seconds in the call and from one call to the next; on CUDA also the
device's seconds inside the call and between two calls (events recorded around it), medians
in microseconds. Kernel time that stays the same while the device's span inside the call
grows means the replay itself runs with gaps.

    python benchmarks/probe_neighbor.py [--model-path P] [--second adaptive]
        [--algorithm STANDALONE] [--draft DIR] [--batch 16] [--rounds 2] [--close]
        [--second-kw disable_cuda_graph=true ...] [--second-first] [--recapture]
        [--held-alone] [--out benchmarks/results/neighbor.jsonl]

--second-kw sets Engine arguments of the second engine alone: a drafted engine without its
decode graphs (disable_cuda_graph=true), or NGRAM (no draft model), tells which part of its
start-up the first engine's steps feel. --second-first builds the second engine before the
first one and keeps it: whether the order matters. --recapture captures the first engine's
decode graphs again once the second engine stands, then times its rounds again: whether graphs
captured before the second engine's start-up are the ones that slow down. --held-alone builds
the second engine alone (adaptive, held to plain steps) and times its own target's decode
steps, as a user's one engine a process runs them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import common

common.add_repo_to_path()

from bench_adaptive import engine_kwargs, prompts_for  # noqa: E402

SECONDS = ("no-spec", "pinned", "adaptive")


class ForwardClock:
    """Wraps DecodeGraphRunner.forward while on: each call's host start and end, and on CUDA
    an event before and after it."""

    def __init__(self, cuda: bool):
        from specpcg.graphs.decode_runner import DecodeGraphRunner

        self.cls, self.real, self.cuda, self.calls = DecodeGraphRunner, DecodeGraphRunner.forward, \
            cuda, []

    def __enter__(self):
        real, calls, cuda = self.real, self.calls, self.cuda
        calls.clear()

        def timed(runner, batch):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
            start = time.perf_counter()
            if events:
                events[0].record()
            out = real(runner, batch)
            if events:
                events[1].record()
            calls.append((start, time.perf_counter(), events))
            return out
        self.cls.forward = timed
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.real
        if self.cuda:
            torch.cuda.synchronize()

    def medians(self) -> dict:
        """Microseconds, medians over the calls but the first and last two (the batch's
        start and end)."""
        calls = self.calls[2:-2]
        pairs = list(zip(calls, calls[1:]))
        out = {"host_in_call_us": _med((e - s) * 1e6 for s, e, _ in calls),
               "host_call_to_call_us": _med((b[0] - a[0]) * 1e6 for a, b in pairs)}
        if self.cuda and calls:
            out["device_in_call_us"] = _med(ev[0].elapsed_time(ev[1]) * 1e3
                                            for _, _, ev in calls)
            out["device_between_calls_us"] = _med(a[2][1].elapsed_time(b[2][0]) * 1e3
                                                  for a, b in pairs)
        return out


LIMITS = {"stack_bytes": 0, "malloc_heap_bytes": 2, "persisting_l2_bytes": 6}  # CUlimit


def context_limits() -> dict:
    """The CUDA context's limits (cuCtxGetLimit) that a kernel launched later can raise for
    every kernel after it, such as the per-thread stack; {} off CUDA or without the driver."""
    import ctypes

    if not torch.cuda.is_available():
        return {}
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {}
    out = {}
    for name, limit in LIMITS.items():
        value = ctypes.c_size_t()
        if driver.cuCtxGetLimit(ctypes.byref(value), limit) == 0:
            out[name] = value.value
    return out


def engine_value(text: str):
    """KEY=VALUE's value: true / false, an int, a float, or the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_kw(pairs: list) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--second-kw: expected KEY=VALUE, got {pair!r}")
        out[key] = engine_value(value)
    return out


def _med(values) -> float:
    values = list(values)
    return round(common.median(values), 1) if values else 0.0


def timed_rounds(engine, prompts: list, params: dict, rounds: int, stage: str) -> list:
    lines = []
    for rnd in range(rounds):
        with ForwardClock(engine.device.type == "cuda") as clock:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t0
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        lines.append({"probe": "neighbor", "stage": stage, "round": rnd,
                      "tok_s": round(tokens / wall), "verifies": verifies, **clock.medians(),
                      "context_limits": context_limits()})
        print(json.dumps(lines[-1]), flush=True)
    return lines


def recapture(engine) -> None:
    """Captures the engine's decode graphs again (its runner keeps the new ones)."""
    decode = engine.graphs.decode
    if decode is None:
        raise SystemExit(f"--recapture: the engine on {engine.device} has no decode graphs")
    decode.capture()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--second", choices=SECONDS, default="adaptive")
    p.add_argument("--algorithm", default="STANDALONE")
    p.add_argument("--draft", default=None, help="the second engine's draft (STANDALONE: a "
                                                 "model path; the model itself if left out)")
    p.add_argument("--setting", default="3,1,4", help="steps,topk,tokens")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--close", action="store_true", help="then close the second engine")
    p.add_argument("--recapture", action="store_true",
                   help="then capture the first engine's decode graphs again, beside it")
    p.add_argument("--held-alone", action="store_true",
                   help="build the second engine alone, held to plain steps (adaptive only), "
                        "and time its own rounds: with --recapture, again after capturing its "
                        "decode graphs once more")
    p.add_argument("--second-first", action="store_true",
                   help="build the second engine before the first (no round alone)")
    p.add_argument("--second-kw", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Engine arguments of the second engine alone")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None, extra: dict = None) -> list:
    """extra: more Engine arguments for both engines (a test's CPU dtype, no tokenizer)."""
    args = parse_args(argv)
    from bench_accept import close
    from specpcg import Engine
    from specpcg.models.loader import default_model_path

    model = args.model_path or str(default_model_path())
    draft = args.draft or (model if args.algorithm == "STANDALONE" else None)
    common_kw = dict(model_path=model, show_progress=False, max_running_requests=args.batch,
                     cuda_graph_max_bs=args.batch, **({"device": args.device}
                                                      if args.device else {}), **(extra or {}))
    second_kw = parse_kw(args.second_kw)
    second_all = {**common_kw, **engine_kwargs(args.second, args.algorithm, draft,
                                               common.parse_setting(args.setting)), **second_kw}
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    if args.held_alone:
        return finish(held_alone(Engine(**second_all), args, params), args, second_kw)
    # The engine built first takes 0.4 of the device's memory, the other 0.8 of it all (what
    # is left): as bench_adaptive sizes engines that share a device.
    second = Engine(**{"mem_fraction_static": 0.4, **second_all}) if args.second_first else None
    first = Engine(mem_fraction_static=0.8 if second else 0.4, **common_kw)
    prompts = prompts_for(first, args.batch, 128)[:args.batch]
    first.generate(input_ids=prompts, sampling_params=params)  # untimed
    lines = []
    if second is None:
        lines += timed_rounds(first, prompts, params, args.rounds, "alone")
        second = Engine(**{"mem_fraction_static": 0.8, **second_all})
    stage = f"built after {args.second}" if args.second_first else f"beside {args.second}"
    lines += timed_rounds(first, prompts, params, args.rounds, stage)
    if args.recapture:  # graphs captured after the second engine's start-up
        recapture(first)
        first.generate(input_ids=prompts, sampling_params=params)  # untimed
        lines += timed_rounds(first, prompts, params, args.rounds, f"recaptured, {stage}")
    if args.close:
        close(second)
        lines += timed_rounds(first, prompts, params, args.rounds, f"{args.second} closed")
    return finish((first, lines), args, second_kw)


def held_alone(engine, args, params: dict) -> tuple:
    """(engine, lines): an engine with a draft alone in the process, held to plain steps: its
    target's decode steps with the draft's start-up behind them (and, with --recapture, after
    its decode graphs were captured again, last)."""
    from holds import plain_only

    if engine.scheduler.adaptive is None:
        raise SystemExit(f"--held-alone: --second {args.second} has no adaptive controller to "
                         "hold to plain steps; use --second adaptive")
    plain_only(engine)
    prompts = prompts_for(engine, args.batch, 128)[:args.batch]
    engine.generate(input_ids=prompts, sampling_params=params)  # untimed
    lines = timed_rounds(engine, prompts, params, args.rounds, "held plain, alone")
    if args.recapture:
        recapture(engine)
        engine.generate(input_ids=prompts, sampling_params=params)  # untimed
        lines += timed_rounds(engine, prompts, params, args.rounds,
                              "held plain, alone, recaptured")
    return engine, lines


def finish(measured: tuple, args, second_kw: dict) -> list:
    """The lines with what was measured, appended to --out."""
    engine, lines = measured
    info = {"second": args.second, "algorithm": args.algorithm if args.second != "no-spec"
            else None, "second_kw": second_kw, "second_first": args.second_first,
            "held_alone": args.held_alone, "batch": args.batch,
            **common.machine_info(engine.device)}
    lines = [{**line, **info} for line in lines]
    if args.out:
        common.append_jsonl(args.out, lines)
    return lines


if __name__ == "__main__":
    main()
