"""Plots what chain depth per batch size decides on: a speculative step's time per batch-size
bucket at each depth (the step graphs' replays timed at capture), one panel per results file,
from the `chain_depth` field that bench_accept (--chain-depth) and bench_adaptive lines carry.

    python benchmarks/plot_chain_depth.py FILE.jsonl [FILE.jsonl ...] --out PNG
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def step_series(record: dict) -> dict:
    """{"depth d": [(bucket, step ms), ...]} from a line's chain_depth.step_ms ("BxD" keys)."""
    series: dict = {}
    for key, ms in record["chain_depth"]["step_ms"].items():
        bucket, depth = (int(v) for v in key.split("x"))
        series.setdefault(f"depth {depth}", []).append((bucket, ms))
    return series


def panel(path: str) -> dict:
    lines = [r for r in common.read_jsonl(path) if r.get("chain_depth")]
    if not lines:
        raise SystemExit(f"{path}: no line carries chain_depth")
    last = lines[-1]
    model = last.get("model") or "default"
    return {"title": f"{model}, {last.get('device', '?')} ({last.get('git', '?')})",
            "xlabel": "batch-size bucket", "ylabel": "step ms (graph replay)", "logx": True,
            "series": step_series(last)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    common.line_plot([panel(f) for f in args.files], args.out,
                     "Speculative step time by chain depth (NGRAM chain of 7)")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
