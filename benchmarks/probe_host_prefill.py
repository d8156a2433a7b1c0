"""The host's share of a prefill: the engine's own work around the model (requests, slots, the
batch and its copy, sampling, freeing), with the model's body and LM head replaced by zeros,
so that only the Python and numpy work is timed. CPU; one generate of one new token per
(batch, prompt length), the minimum of --repeats runs.

    python benchmarks/probe_host_prefill.py [--model-path PATH] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import common

common.add_repo_to_path()

CELLS = [(1, 16), (8, 16), (1, 512), (8, 512)]


def faked_engine(model_path):
    from specpcg import Engine, model_runner

    engine = Engine(model_path=model_path, device="cpu", show_progress=False,
                    chunked_prefill_size=8192)
    # Zeros made once and handed out as views: making them each call (9 MB for 8 x 512 tokens)
    # took more of the 2-core CPU's time than the host work timed, and varied as much.
    hidden = torch.zeros(max(bs * n for bs, n in CELLS), engine.model_config.hidden_size)
    logits = torch.zeros(max(bs for bs, _ in CELLS), engine.model_config.vocab_size)
    model_runner.ModelRunner.call_model = lambda self, batch: (hidden[:batch.num_tokens], [])
    engine.model.compute_logits = lambda h: logits[:h.shape[0]]
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    engine = faked_engine(args.model_path)
    rng = random.Random(0)
    for bs, length in CELLS:
        ids = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(bs)]
        common.generate_ids(engine, ids, 1)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            common.generate_ids(engine, ids, 1)
            times.append(time.perf_counter() - t0)
        print(f"batch {bs} x {length} tokens: host {1e3 * min(times):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
