"""Chain depth per batch size, looked at directly: an NGRAM engine (default: 7 steps) and a
no-spec one on the same chat prompts at batch 1, 16 and 64, greedy. Prints each engine's
tok/s, the speculative step graphs' widths, capture time and per-(bucket, depth) replay times,
the depth each bucket picked with the acceptance shares behind it, and how many outputs match
no-spec token for token.

    python benchmarks/probe_chain_depth.py [--steps 7] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCHES = (1, 16, 64)


def run(name: str, kw: dict, prompts, params) -> tuple:
    from specpcg import Engine

    from bench_adaptive import prompts_for

    start = time.time()
    engine = Engine(max_running_requests=max(BATCHES), cuda_graph_max_bs=max(BATCHES),
                    show_progress=False, **kw)
    print(f"{name}: loaded in {time.time() - start:.1f} s", flush=True)
    prompts = prompts or prompts_for(engine, max(BATCHES), 256)
    outputs = {}
    for bs in BATCHES:
        engine.generate(input_ids=prompts[:bs], sampling_params=[params] * bs)  # warm
        start = time.time()
        outs = engine.generate(input_ids=prompts[:bs], sampling_params=[params] * bs)
        seconds = time.time() - start
        outputs[bs] = [o["output_ids"] for o in outs]
        print(f"{name} bs {bs}: {bs * params['max_new_tokens'] / seconds:,.0f} tok/s",
              flush=True)
    info = engine.get_server_info()["speculative"]
    if info:
        graphs = {k: v for k, v in info["step_graphs"].items() if k != "batch_sizes"}
        print("step graphs:", json.dumps(graphs))
        print("adaptive:", json.dumps(info["adaptive"]))
    engine.shutdown()
    return prompts, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompts, plain = run("no-spec", {}, None, params)
    _, spec = run("NGRAM", dict(speculative_algorithm="NGRAM", speculative_num_steps=args.steps),
                  prompts, params)
    for bs in BATCHES:
        same = sum(a == b for a, b in zip(plain[bs], spec[bs]))
        print(f"bs {bs}: {same} of {bs} outputs identical to no-spec")


if __name__ == "__main__":
    main()
