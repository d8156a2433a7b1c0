"""`python -m drafts.evaluate`: a trained draft's offline and online accept length, side by side.

    python -m drafts.evaluate --draft DIR [--data SPEC] [--num-prompts 120] [--max-new-tokens 192]
        [--settings 3,1,4 7,1,8] [--batch-size 16] [--no-ngram] [--out results.jsonl]

On held-out prompts of the data (default: the draft's own training data; drafts.data holds
out what no draft trains on): the target answers every prompt greedily (no speculation), the
draft's chains are simulated on those answers (drafts.offline: "offline"), then the engine runs
the same prompts with the draft at each setting ("online"). The two accept lengths must agree:
a gap means the trainer and the engine feed the draft differently. Trees are online only.
NGRAM runs the same prompts at each setting too, so the draft's margin over it is measured on
the prompts the draft is measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

from drafts.data import DEFAULT_DATA, heldout_samples
from drafts.distill import self_distill
from drafts.offline import draft_hits, load_draft_model, offline_accept
from drafts.train_data import extract_features

# Held-out prompts per run: the accept length is a mean over prompts, and more prompts make it
# tighter; 118 chat and 40 GSM8K prompts, both settings, took about 2.5 minutes on the H100.
NUM_PROMPTS = 120
EVAL_KV_TOKENS = 1 << 16  # 16 requests of up to 4,096 tokens


def read_log(draft: str) -> dict:
    path = os.path.join(draft, "train_log.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def parse_settings(items: list) -> list:
    out = []
    for item in items:
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"settings {item!r}: expected steps,topk,tokens such as 7,1,8")
        out.append(tuple(int(p) for p in parts))
    return out


def _engine(target, device, batch_size: int, **spec):
    from specpcg import Engine

    # A bounded KV cache, not a share of free memory: evaluations run beside training.
    return Engine(model_path=target, device=device, show_progress=False,
                  max_running_requests=batch_size, max_total_tokens=EVAL_KV_TOKENS, **spec)


def online(target, device, algorithm, draft, setting, prompts, max_new_tokens, batch_size,
           reference) -> dict:
    """The engine's accept length with the draft at `setting` (pooled over requests, bonus
    token included) and how many outputs equal the no-spec reference."""
    steps, topk, tokens = setting
    engine = _engine(target, device, batch_size, speculative_algorithm=algorithm,
                     speculative_draft_model_path=draft,
                     speculative_num_steps=steps,
                     speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                     # every step speculative: the accept length of this draft, as offline walks it
                     disable_adaptive_speculation=True)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0})
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    hist = [0] * tokens
    for o in outs:
        for m, c in enumerate(o["meta_info"]["spec_accept_histogram"]):
            hist[m] += c
    done = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    same = sum(o["output_ids"] == r for o, r in zip(outs, reference))
    return {"accept_length": done / max(verifies, 1), "verifies": verifies, "tokens": done,
            "accept_histogram": hist, "identical_to_no_spec": same, "elapsed_s": elapsed}


def evaluate_draft(draft: str, data: Optional[str] = None, num_prompts: int = NUM_PROMPTS,
                   max_new_tokens: int = 192, settings=((3, 1, 4), (7, 1, 8)),
                   batch_size: int = 16, algorithm: Optional[str] = None,
                   target: Optional[str] = None, device: str = "auto", seed: int = 0,
                   ngram: bool = True) -> dict:
    log = read_log(draft)
    algorithm = algorithm or log.get("algorithm")
    target = target or log.get("target")
    if not algorithm:
        raise ValueError(f"draft {draft!r} has no train_log.json: pass algorithm")
    data = data or log.get("data") or DEFAULT_DATA
    samples = heldout_samples(data, num_prompts, seed)
    engine = _engine(target, device, batch_size)
    seqs = self_distill(engine, samples, max_new_tokens, max_turns=1, show_progress=False)
    prompts = [t[:p] for t, p in zip(seqs.token_ids, seqs.prompt_lens)]
    reference = [t[p:] for t, p in zip(seqs.token_ids, seqs.prompt_lens)]
    model, cfg, dev, dtype = engine.model, engine.model_config, engine.device, engine.dtype
    engine.shutdown()
    record = {"draft": draft, "algorithm": algorithm, "data": data,
              "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "settings": {}}
    chains = [s for s in settings if s[1] == 1]
    offline = {}
    if chains:
        from drafts.train import FEATURES, _feature_layers

        head = load_draft_model(algorithm, draft, model, cfg, dev, dtype)
        aux = tuple(getattr(getattr(head, "spec", None), "aux_layer_ids", ()) or ())
        feats = extract_features(model, seqs, _feature_layers(algorithm, aux),
                                 FEATURES[algorithm] is not None, dev, show_progress=False)
        ids = list(range(feats.num_seqs))
        hits = draft_hits(algorithm, head, feats, ids, max(s[0] for s in chains), dev)
        offline = offline_accept(hits, feats.prompt_lens, tuple(s[0] for s in chains))
        del head, feats
    for s in settings:
        key = ",".join(map(str, s))
        row = {"online": online(target, device, algorithm, draft, s, prompts, max_new_tokens,
                                batch_size, reference)}
        if ngram:
            row["ngram"] = online(target, device, "NGRAM", None, s, prompts, max_new_tokens,
                                  batch_size, reference)
        if key in offline:
            row["offline"] = offline[key]
            row["offline_over_online"] = (offline[key]["accept_length"]
                                          / row["online"]["accept_length"])
        record["settings"][key] = row
    return record


def print_record(record: dict) -> None:
    print(f"{record['algorithm']} {record['draft']} on {record['num_prompts']} held-out prompts "
          f"of {record['data']} ({record['device']}, {record['dtype']}):")
    print("setting   offline AL   online AL   offline/online   NGRAM AL   identical to no-spec")
    nan = float("nan")
    for key, row in record["settings"].items():
        on, off, ng = row["online"], row.get("offline"), row.get("ngram")
        print(f"{key:9} {off['accept_length'] if off else nan:10.3f}   "
              f"{on['accept_length']:9.3f}   {row.get('offline_over_online', nan):14.3f}   "
              f"{ng['accept_length'] if ng else nan:8.3f}   "
              f"{on['identical_to_no_spec']}/{record['num_prompts']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a draft directory from drafts.train")
    p.add_argument("--data", default=None, help="source spec (default: the draft's own)")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--settings", nargs="+", default=["3,1,4", "7,1,8"],
                   metavar="STEPS,TOPK,TOKENS")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--algorithm", default=None, help="default: the draft's train_log.json")
    p.add_argument("--target", default=None, help="default: the draft's train_log.json")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-ngram", action="store_true", help="skip NGRAM on the same prompts")
    p.add_argument("--out", default=None, help="append the record as a JSON line")
    a = p.parse_args(argv)
    record = evaluate_draft(a.draft, a.data, a.num_prompts, a.max_new_tokens,
                            parse_settings(a.settings), a.batch_size, a.algorithm, a.target,
                            a.device, ngram=not a.no_ngram)
    print_record(record)
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
