"""Batch-1 decode speed of earlier commits side by side: no-spec and NGRAM (7, 1, 8), one
engine each, on six chat prompts through the chat template, in one process per commit.

Each commit's engine code (specpcg/, drafts/, kernels/) is unpacked into a folder of its own,
and this probe imports it from there, so one machine times every commit in one call:

    python benchmarks/probe_commits.py --make-trees .gpu/bisect 8142307 f6fa0f1 ...   # here
    for c in 8142307 f6fa0f1 ...; do python benchmarks/probe_commits.py --tree .gpu/bisect/$c; done

Each line: the commit, tok/s of no-spec and of NGRAM (the better of two passes over the
prompts, one request at a time, 160 greedy tokens), and NGRAM's accept length. The engines are
small (4 requests, no piecewise graphs): the figures compare commits, not the engine's best.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = ["What are three tips for staying focused while working from home?",
           "Explain what a black hole is to a ten-year-old.",
           "Write a short poem about autumn leaves.",
           "How do I make a simple tomato pasta sauce?",
           "What is the difference between weather and climate?",
           "Give me a packing list for a weekend camping trip."]
NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_steps=7,
             speculative_num_draft_tokens=8, disable_adaptive_speculation=True)


def make_trees(folder: str, commits: list) -> None:
    for c in commits:
        dest = os.path.join(folder, c)
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(["git", "archive", c, "specpcg", "drafts", "kernels"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def _engine(**spec):
    from specpcg import Engine

    kw = dict(show_progress=False, max_running_requests=4, cuda_graph_max_bs=4,
              disable_piecewise_cuda_graph=True, max_total_tokens=16384, **spec)
    try:
        return Engine(**kw)
    except (TypeError, ValueError):  # a commit from before the option
        kw.pop("disable_adaptive_speculation", None)
        return Engine(**kw)


def time_tree(tree: str, new_tokens: int) -> dict:
    sys.path.insert(0, tree)
    out = {"bench": "probe_commits", "commit": os.path.basename(tree.rstrip("/"))}
    for name, spec in (("nospec", {}), ("ngram", NGRAM)):
        engine = _engine(**spec)
        ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in PROMPTS]
        params = {"max_new_tokens": new_tokens, "temperature": 0}
        engine.generate(input_ids=ids[:1], sampling_params={"max_new_tokens": 16,
                                                              "temperature": 0})
        best = 0.0
        for _ in range(2):
            t0, done = time.perf_counter(), 0
            for x in ids:
                done += engine.generate(input_ids=[x], sampling_params=params)[0][
                    "meta_info"]["completion_tokens"]
            best = max(best, done / (time.perf_counter() - t0))
        out[name] = round(best, 1)
        if name == "ngram":
            state = engine.get_server_info()["internal_states"][0]
            out["al"] = round(state.get("avg_spec_accept_length", 0), 3)
        engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-trees", nargs="+", metavar=("FOLDER", "COMMIT"))
    p.add_argument("--tree", help="a folder made by --make-trees")
    p.add_argument("--new-tokens", type=int, default=160)
    a = p.parse_args()
    if a.make_trees:
        make_trees(a.make_trees[0], a.make_trees[1:])
    if a.tree:
        print(json.dumps(time_tree(a.tree, a.new_tokens)), flush=True)


if __name__ == "__main__":
    main()
