"""What a speculative step costs, chain against tree: an EAGLE3 head with random weights (so
nearly every draft is rejected and both settings take one step per token) at (7, 1, 8) and
(5, 4, 8), batch 1 and 16, 96 tokens each, with no-spec beside them in one process. The figure
is milliseconds per verify step; the draft's forward stats say which forwards replayed graphs.

    python benchmarks/probe_tree_round.py [--model-path PATH] [--out results/tree_round.jsonl]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import common

common.add_repo_to_path()

SETTINGS = ((7, 1, 8), (5, 4, 8))
BATCHES = (1, 16)


def _timed(engine, prompts: list, params: dict) -> tuple:
    """(seconds, verify steps) of one batch after one untimed run."""
    engine.generate(input_ids=prompts, sampling_params=params)
    common.synchronize(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    common.synchronize(engine.device)
    steps = max(o["meta_info"].get("spec_verify_ct") or len(o["output_ids"]) for o in outs)
    return time.perf_counter() - t0, steps


def _random_head(engine) -> str:
    import torch
    from drafts.head_checkpoint import random_head, save_head

    cfg = engine.model_config
    head, spec = random_head("EAGLE3", cfg, "cpu", torch.float32, draft_vocab_size=8192)
    return save_head(head.to(torch.bfloat16), spec, cfg, tempfile.mkdtemp())


def main(argv=None) -> None:
    from specpcg import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "tree_round.jsonl"))
    args = p.parse_args(argv)
    params = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
    plain = Engine(model_path=args.model_path, show_progress=False)
    prompts = [plain.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Tell me about topic {i}."}]) for i in range(max(BATCHES))]
    head = _random_head(plain)
    base = {"bench": "tree_round", **common.machine_info(plain.device)}
    rows = []
    for bs in BATCHES:
        dt, steps = _timed(plain, prompts[:bs], params)
        rows.append({**base, "setting": "no-spec", "bs": bs, "ms_per_step": dt * 1e3 / steps})
    plain.shutdown()
    for steps_, topk, tokens in SETTINGS:
        engine = Engine(model_path=args.model_path, show_progress=False,
                        speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                        speculative_num_steps=steps_, speculative_eagle_topk=topk,
                        speculative_num_draft_tokens=tokens, disable_adaptive_speculation=True)
        for bs in BATCHES:
            dt, steps = _timed(engine, prompts[:bs], params)
            rows.append({**base, "setting": f"{steps_},{topk},{tokens}", "bs": bs,
                         "ms_per_step": dt * 1e3 / steps,
                         "draft_forwards": engine.draft.router.forward_stats()})
        engine.shutdown()
    for r in rows:
        print(f"[probe_tree_round] {r['setting']:>8} bs {r['bs']:>2}  "
              f"{r['ms_per_step']:.2f} ms per step", flush=True)
    common.append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
