"""A look's steps against pinned speculation's steady ones, from probe_adaptive_steps' logs.

PINNED: a log of `--systems pinned`; SCRIPTED: a log of `--systems adaptive --script P S` (a
look every P plain steps). Per batch size, one JSON line: pinned's steady speculative calls
(the first and last 3 left out), and of the scripted engine's recorded steps: the first
speculative one of each look (the switch, which the controller prices and does not count), the
ones after it (what the look measures), and the plain ones. Each as median milliseconds, tokens
per request a step, and tokens per second per request.

    python benchmarks/report_looks.py PINNED.jsonl SCRIPTED.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

import common


def _stats(events: list) -> dict:
    if not events:
        return {"steps": 0}
    seconds = sum(e["s"] for e in events)
    per_req = [e["tokens"] / e["bs"] for e in events]
    return {"steps": len(events), "ms": round(statistics.median(e["s"] for e in events) * 1e3, 3),
            "tokens_per_req": round(statistics.mean(per_req), 2),
            "tok_s_per_req": round(sum(per_req) / seconds) if seconds else 0}


def looks(records: list) -> tuple:
    """(each look's first speculative record, the look's later ones) of a run of records."""
    runs, current = [], []
    for e in records:
        if e["spec"]:
            current.append(e)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [r[0] for r in runs], [e for r in runs for e in r[1:]]


def report(pinned: list, scripted: list) -> list:
    lines = []
    for bs in sorted({e["batch"] for e in scripted if "batch" in e}):
        steady = [e for e in pinned if e.get("batch") == bs and e.get("kind") == "spec"][3:-3]
        records = [e for e in scripted if e.get("batch") == bs and e.get("kind") == "record"]
        switch, counted = looks(records)
        lines.append({"report": "looks", "batch": bs, "pinned_steady": _stats(steady),
                      "look_switch": _stats(switch), "look_counted": _stats(counted),
                      "plain": _stats([e for e in records if not e["spec"]])})
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pinned")
    p.add_argument("scripted")
    args = p.parse_args(argv)
    for line in report(common.read_jsonl(args.pinned), common.read_jsonl(args.scripted)):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
