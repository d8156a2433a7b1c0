"""What adaptive speculation did, step by step, on one batch: its choices and measured rates per
bucket, and which runner served every forward (a plain step that fell back to eager would
explain a slow plain rate).

    python benchmarks/probe_adaptive.py --draft DIR [--batch 1] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time

import common

common.add_repo_to_path()
from specpcg import Engine  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--draft", required=True, help="an EAGLE3 head")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    from drafts.data import heldout_samples
    from drafts.distill import first_prompts

    engine = Engine(model_path=args.model_path, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=args.draft, show_progress=False)
    prompts = first_prompts(heldout_samples("sharegpt", 4 * args.batch), engine.tokenizer,
                            args.batch)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    for run in range(3):
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"run {run}: {tokens / seconds:.0f} tok/s")
    info = engine.get_server_info()
    print(json.dumps({"adaptive": info["speculative"]["adaptive"],
                      "overlapped_steps": info["speculative"]["overlapped_steps"],
                      "target": info["forward_stats"],
                      "draft": engine.draft.router.forward_stats()}, indent=1))


if __name__ == "__main__":
    main()
