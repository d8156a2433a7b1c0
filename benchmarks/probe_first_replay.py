"""Each captured graph's first replay against its next ones: what CUDA's lazy upload of an
instantiated graph costs the first serving step that needs it.

An engine with a draft (bench_adaptive's probe options) is built with
`breakable.REPLAY_ON_CAPTURE` off, every graph captured through `warm_and_capture` (decode,
draft rounds and catch-ups, overlapped steps) recorded; then each graph replays --replays
times, each replay timed between device syncs, with no request in flight (a graph's buffers
still hold padding or a finished request's inputs). One JSON line per graph and a summary.

    python benchmarks/probe_first_replay.py --model-path shape:smollm2-135m --untrained \
        [--algorithm EAGLE3] [--setting 7,1,8] [--most 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common
from bench_adaptive import add_probe_args, probe_engine

common.add_repo_to_path()

MODULES = ("specpcg.graphs.decode_runner", "specpcg.graphs.draft_runner",
           "specpcg.speculative.step_graph")


def record_captures() -> list:
    """Turns the replay on capture off and returns the list every later capture joins:
    (module, graph)."""
    import importlib

    from specpcg.graphs import breakable

    breakable.REPLAY_ON_CAPTURE = False
    captured = []
    for name in MODULES:
        module = importlib.import_module(name)

        def recorded(fn, pool, _name=name.rsplit(".", 1)[-1]):
            graph, out = breakable.warm_and_capture(fn, pool)
            captured.append((_name, graph))
            return graph, out
        module.warm_and_capture = recorded
    return captured


def time_replays(graph, replays: int) -> list:
    """Milliseconds of each of `replays` replays, the device synced around each."""
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(p)
    p.add_argument("--most", type=int, default=8, help="the engine's largest batch")
    p.add_argument("--replays", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    captured = record_captures()
    engine, _ = probe_engine(args, "adaptive", args.most)  # kept: its graphs' pools live with it
    rows = []
    for module, graph in captured:
        times = time_replays(graph, args.replays)
        rows.append({"probe": "first_replay", "module": module, "first_ms": round(times[0], 3),
                     "next_ms": round(statistics.median(times[1:]), 3)})
        common.emit_line(rows[-1], args.out)
    extra = [r["first_ms"] - r["next_ms"] for r in rows]
    summary = {"probe": "first_replay_summary", "graphs": len(rows),
               "extra_ms_median": round(statistics.median(extra), 3) if extra else None,
               "extra_ms_max": round(max(extra), 3) if extra else None,
               "extra_ms_total": round(sum(extra), 3), "most": args.most,
               "setting": args.setting}
    common.emit_line({**summary, **common.machine_info(torch.device("cuda"))}, args.out)


if __name__ == "__main__":
    main()
