"""Are plain decode steps slower in an engine with a draft? The same 64 held-out chat prompts
(128 greedy tokens) through three engines in one process: no-spec, NGRAM held to plain steps
(its adaptive controller answers "plain" every time), and NGRAM pinned to speculate. Prints
tok/s of 3 timed batches each (after one untimed) and each engine's forward stats.

    python benchmarks/probe_plain_steps.py [--model-path PATH]
"""

from __future__ import annotations

import argparse
import time

import common

common.add_repo_to_path()

ENGINES = (("no-spec", {}),
           ("NGRAM held to plain steps", dict(speculative_algorithm="NGRAM")),
           ("NGRAM pinned", dict(speculative_algorithm="NGRAM",
                                 disable_adaptive_speculation=True)))


def main(argv=None) -> None:
    from bench_adaptive import prompts_for
    from specpcg import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    args = p.parse_args(argv)
    params = {"max_new_tokens": 128, "temperature": 0}
    for name, kw in ENGINES:
        engine = Engine(model_path=args.model_path, show_progress=False, **kw)
        if name == "NGRAM held to plain steps":
            engine.scheduler.adaptive.use_spec = lambda *args, **kwargs: False
        prompts = prompts_for(engine, 64, 0)
        engine.generate(input_ids=prompts, sampling_params=params)
        rates = []
        for _ in range(3):
            common.synchronize(engine.device)
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            common.synchronize(engine.device)
            rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs)
                         / (time.perf_counter() - t0))
        print(f"[probe_plain_steps] {name}: tok/s {[round(r) for r in rates]}", flush=True)
        print(f"[probe_plain_steps] {name}: {engine.get_server_info()['forward_stats']}",
              flush=True)
        engine.shutdown()


if __name__ == "__main__":
    main()
