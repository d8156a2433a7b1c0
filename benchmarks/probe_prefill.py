"""Where a piecewise prefill's time goes: engine TTFT against the body's replay, split into graph
segments and eager breaks (host time), the body's GPU time, and a cProfile of one prefill.

For each prompt length at batch 1 (and 8): the median TTFT of --repeats greedy one-token requests
on a graphs engine, then the same requests with BreakableGraph.replay instrumented (host seconds
spent replaying segments, running breaks, and the whole replay; GPU milliseconds of the replay
from CUDA events). Writes JSON lines (--out) and a cProfile text (--profile-out) of one prefill
at the longest length (and, with --decode-profile-out, of a batch-1 decode).

    python benchmarks/probe_prefill.py --out prefill_probe.jsonl --profile-out prefill.prof.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import common

common.add_repo_to_path()
import bench_engine  # noqa: E402

from specpcg.graphs import breakable  # noqa: E402


class ReplayClock:
    """Wraps BreakableGraph.replay: host seconds in segments, in breaks and in all; GPU ms."""

    def __init__(self):
        self.segment_s = self.break_s = self.total_s = 0.0
        self.gpu_ms, self.replays, self.breaks = 0.0, 0, 0
        self._orig = breakable.BreakableGraph.replay

    def __enter__(self):
        clock = self

        def replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            with torch.inference_mode():
                for i, segment in enumerate(graph.segments):
                    t = time.perf_counter()
                    segment.replay()
                    clock.segment_s += time.perf_counter() - t
                    if i < len(graph.breaks):
                        t = time.perf_counter()
                        graph.breaks[i]()
                        clock.break_s += time.perf_counter() - t
                        clock.breaks += 1
            end.record()
            clock.total_s += time.perf_counter() - t0
            end.synchronize()
            clock.gpu_ms += start.elapsed_time(end)
            clock.replays += 1

        breakable.BreakableGraph.replay = replay
        return self

    def __exit__(self, *exc):
        breakable.BreakableGraph.replay = self._orig

    def per_replay(self) -> dict:
        n = max(self.replays, 1)
        return {"replays": self.replays, "breaks_per_replay": self.breaks / n,
                "host_segments_ms": 1e3 * self.segment_s / n, "host_breaks_ms": 1e3 * self.break_s / n,
                "host_replay_ms": 1e3 * self.total_s / n, "gpu_replay_ms": self.gpu_ms / n,
                "host_per_break_us": 1e6 * self.break_s / max(self.breaks, 1)}


def ttft_ms(engine, ids, repeats: int) -> float:
    times = [common.timed(lambda: common.generate_ids(engine, ids, 1), engine.device)[1]
             for _ in range(repeats)]
    return 1e3 * common.median(times)


def profile_text(engine, ids, top: int, num_new: int = 1) -> str:
    prof = cProfile.Profile()
    prof.enable()
    common.generate_ids(engine, ids, num_new)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--lens", type=int, nargs="+", default=[16, 128, 512, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--profile-out", default=None)
    p.add_argument("--decode-profile-out", default=None,
                   help="also a cProfile of a batch-1 generation of 256 tokens")
    args = p.parse_args()
    from specpcg import Engine

    engine = Engine(model_path=args.model_path, show_progress=False, max_total_tokens=65536,
                    max_running_requests=64, chunked_prefill_size=8192,
                    piecewise_cuda_graph_max_tokens=4096)
    stream = torch.randint(100, 32000, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
    base = {"bench": "probe_prefill", **common.machine_info(engine.device)}
    records = []
    for bs in args.batches:
        for n in args.lens:
            if bs * n > 4096:
                continue
            ids = bench_engine.make_prompts(stream, bs, n)
            common.generate_ids(engine, ids, 1)  # warm-up
            ttft = ttft_ms(engine, ids, args.repeats)
            with ReplayClock() as clock:
                ttft_clocked = ttft_ms(engine, ids, args.repeats)
            rec = {**base, "batch": bs, "prompt_len": n, "ttft_ms": round(ttft, 3),
                   "ttft_clocked_ms": round(ttft_clocked, 3),
                   **{k: round(v, 4) for k, v in clock.per_replay().items()}}
            print(rec, flush=True)
            records.append(rec)
    if args.out:
        common.append_jsonl(args.out, records)
    if args.profile_out:
        ids = bench_engine.make_prompts(stream, 1, max(args.lens))
        with open(args.profile_out, "w") as f:
            f.write(profile_text(engine, ids, 40))
    if args.decode_profile_out:
        ids = bench_engine.make_prompts(stream, 1, 32)
        seconds = common.timed(lambda: common.generate_ids(engine, ids, 256), engine.device)[1]
        with open(args.decode_profile_out, "w") as f:
            f.write(f"256 tokens at batch 1 unprofiled: {seconds * 1e3:.1f} ms\n")
            f.write(profile_text(engine, ids, 40, num_new=256))
    engine.shutdown()


if __name__ == "__main__":
    main()
