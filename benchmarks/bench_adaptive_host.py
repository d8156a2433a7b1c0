"""Host time of adaptive speculation's per-step decision (no GPU needed).

A warmed controller decides the next step of a running batch with nothing waiting, so it gets a
finish estimate: built and used every step (the controller before REDECIDE_EVERY, which this
sets to 1 for that row, its longest wait too), or lazily, as the scheduler hands it now (built
only on the steps that re-choose). Microseconds per step, by batch size.

    python benchmarks/bench_adaptive_host.py [--batches 1 16 64] [--steps 4000]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import common

common.add_repo_to_path()

from specpcg.speculative import adaptive  # noqa: E402
from specpcg.speculative.adaptive import WARMUP_STEPS, AdaptiveSpeculation, bucket_of  # noqa: E402
from specpcg.speculative.finish import Finish  # noqa: E402


def _warmed(batch: int) -> AdaptiveSpeculation:
    """Both sides measured in every bucket up to `batch` (the finish estimate asks them all)."""
    ctrl, size = AdaptiveSpeculation(), 1
    while size <= bucket_of(batch):
        for _ in range(2 * WARMUP_STEPS + 3):
            spec = ctrl.use_spec(size)
            ctrl.record(size, spec, size * (2 if spec else 1), 0.002 if spec else 0.0015)
        size *= 2
    return ctrl


def _requests(batch: int) -> list:
    return [SimpleNamespace(params=SimpleNamespace(max_new_tokens=128),
                            output_ids=list(range(40 + i % 7)), plain_decode_tokens=30,
                            spec_verify_ct=5, spec_accepted_drafts=4, shadow_recent=None) for i in range(batch)]


def time_us(batch: int, lazy: bool, steps: int) -> float:
    every, most = adaptive.REDECIDE_EVERY, adaptive.REDECIDE_MAX_EVERY
    if not lazy:
        adaptive.REDECIDE_EVERY = adaptive.REDECIDE_MAX_EVERY = 1
    try:
        ctrl, reqs = _warmed(batch), _requests(batch)
        t0 = time.perf_counter()
        for _ in range(steps):
            ctrl.use_spec(batch, (lambda: Finish.of(reqs)) if lazy else Finish.of(reqs))
        return 1e6 * (time.perf_counter() - t0) / steps
    finally:
        adaptive.REDECIDE_EVERY, adaptive.REDECIDE_MAX_EVERY = every, most


def render_table(records: list) -> str:
    latest = [r for r in records if r.get("git") == records[-1].get("git")] if records else []
    rows = [[str(r["batch"]), "lazy" if r["lazy"] else "every step", f"{r['us']:.1f}"]
            for r in latest]
    return common.markdown_table(["batch", "finish estimate", "us per step"], rows)


def render_plot(records: list, path) -> None:
    latest = [r for r in records if r.get("git") == records[-1].get("git")] if records else []
    batches = sorted({r["batch"] for r in latest})
    us = {(r["batch"], r["lazy"]): r["us"] for r in latest}
    panel = {"title": "adaptive decision, host time", "ylabel": "us per step",
             "labels": [f"bs {b}" for b in batches],
             "values": {name: [us.get((b, lazy)) for b in batches]
                        for name, lazy in (("every step", False), ("lazy", True))}}
    common.grouped_bar_plot([panel], ["every step", "lazy"], path,
                            "host time of the adaptive decision per step")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "adaptive_host.jsonl"))
    args = p.parse_args(argv)
    import platform

    lines = [{"bench": "adaptive_host", "batch": b, "lazy": lazy,
              "us": time_us(b, lazy, args.steps), "steps": args.steps,
              "cpu": platform.processor() or platform.machine(), "git": common.git_commit(),
              "time": common.now_iso()}
             for b in args.batches for lazy in (False, True)]
    common.append_jsonl(args.out, lines)
    common.render_results(args.out, render_table, render_plot)


if __name__ == "__main__":
    main()
