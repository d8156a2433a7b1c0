"""Garbage-collector pauses during a generation: with the engine's startup objects frozen out
of the collector (the engine's default, `specpcg.engine.freeze_startup_objects`) and unfrozen.

A tiny random-weight Llama engine (CPU by default) generates --tokens greedy tokens for
--batch prompts, --repeats times per mode; gc callbacks time every collection by generation.
One JSON line per run: tracked objects, the seconds one full collection takes in that mode
(what a pause costs whenever Python decides to collect generation 2), and the collections
that fired during the generation.

    python benchmarks/probe_gc.py [--batch 512] [--tokens 32] [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch

import common

common.add_repo_to_path()


def _timed_collections(run) -> list:
    """(generation, seconds) of every collection during run()."""
    pauses, start = [], [0.0]

    def cb(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - start[0]))

    gc.callbacks.append(cb)
    try:
        run()
    finally:
        gc.callbacks.remove(cb)
    return pauses


def main() -> None:
    from tests.tiny_models import save_tiny_checkpoint, tiny_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON lines file to append to")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = tempfile.mkdtemp(prefix="tiny-llama-")
    save_tiny_checkpoint("llama", path)
    engine = tiny_engine(path, max_total_tokens=args.batch * 120,
                         max_running_requests=args.batch, chunked_prefill_size=16384)
    prompts = [[(i * 7 + j) % 120 + 1 for j in range(30 + i % 20)] for i in range(args.batch)]
    params = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
    lines = []
    for mode in ("unfrozen", "frozen"):  # the engine starts frozen: undo it for the first
        if mode == "unfrozen":
            gc.unfreeze()
        else:
            gc.collect()
            gc.freeze()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            gc.collect()
            one_full = time.perf_counter() - t0
            t0 = time.perf_counter()
            pauses = _timed_collections(lambda: engine.generate(input_ids=prompts,
                                                                sampling_params=params))
            full = [s for g, s in pauses if g == 2]
            lines.append({"bench": "probe_gc", "mode": mode, "batch": args.batch,
                          "tokens": args.tokens, "tracked_objects": len(gc.get_objects()),
                          "one_full_collection_s": one_full,
                          "wall_s": time.perf_counter() - t0, "collections": len(pauses),
                          "full_collections": len(full), "full_s": sum(full),
                          **common.machine_info(engine.device), "git": common.git_commit()})
            print(json.dumps(lines[-1]), flush=True)
    engine.shutdown()
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
