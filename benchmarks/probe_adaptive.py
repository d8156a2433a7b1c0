"""What adaptive speculation did on a few batch sizes: its choices and measured rates per
bucket, which runner served every forward (a plain step that fell back to eager would explain a
slow plain rate), and, on the same prompts in the same process, pinned speculation and no-spec.

    python benchmarks/probe_adaptive.py --draft DIR [--batches 1 16 64] [--max-new-tokens 128]
    python benchmarks/probe_adaptive.py --algorithm NGRAM --bench-prompts [--batches 64]
"""

from __future__ import annotations

import argparse
import json
import time

import common

common.add_repo_to_path()
from specpcg import Engine  # noqa: E402

SYSTEMS = {"adaptive": {}, "pinned": {"disable_adaptive_speculation": True}, "no-spec": None}


def engine_for(system: str, args) -> Engine:
    extra = SYSTEMS[system]
    if extra is None:
        return Engine(model_path=args.model_path, show_progress=False)
    return Engine(model_path=args.model_path, speculative_algorithm=args.algorithm,
                  speculative_draft_model_path=args.draft, show_progress=False, **extra)


def overlapped(engine: Engine) -> int:
    return (engine.get_server_info().get("speculative") or {}).get("overlapped_steps") or 0


def timed(engine: Engine, prompts: list, params: dict, runs: int) -> list:
    """Per run: tok/s, overlapped speculative steps, verifies and plain decode tokens."""
    rates = []
    for _ in range(runs):
        before, t0 = overlapped(engine), time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        metas = [o["meta_info"] for o in outs]
        rates.append({"tok_s": round(sum(m["completion_tokens"] for m in metas) / seconds),
                      "overlapped": overlapped(engine) - before,
                      "verifies": sum(m.get("spec_verify_ct", 0) for m in metas),
                      "plain_tokens": sum(m.get("plain_decode_tokens", 0) for m in metas)})
    return rates


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--draft", default=None, help="the algorithm's head (NGRAM needs none)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bench-prompts", action="store_true",
                   help="bench_adaptive's prompts: the first `batch` of its 64")
    args = p.parse_args(argv)
    from bench_adaptive import prompts_for
    from drafts.data import heldout_samples
    from drafts.distill import first_prompts

    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    for system in SYSTEMS:
        engine = engine_for(system, args)
        for bs in args.batches:
            prompts = (prompts_for(engine, max(args.batches), 128)[:bs] if args.bench_prompts else
                       first_prompts(heldout_samples("sharegpt", 4 * bs), engine.tokenizer, bs))
            print(json.dumps({"system": system, "batch": bs,
                              "runs": timed(engine, prompts, params, args.runs)}), flush=True)
        info = engine.get_server_info()
        spec = info.get("speculative") or {}
        print(json.dumps({"system": system, "adaptive": spec.get("adaptive"),
                          "overlapped_steps": spec.get("overlapped_steps"),
                          "target": info["forward_stats"],
                          "draft": (engine.draft.router.forward_stats()
                                    if getattr(engine.draft, "router", None) else None)},
                         indent=1), flush=True)
        engine.shutdown()


if __name__ == "__main__":
    main()
