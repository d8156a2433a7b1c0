"""The draft trainer's step time: one EAGLE3 head's loop on synthetic features of the default
model's shape, per variant (attention dtype, soft labels, where the features are stored).

Features are random (no generation): the step time depends on the shapes, not on the values.
Each variant draws its own sequence lengths, so every variant meets new batch shapes, as the
first epoch of a real run does. Each variant runs the trainer's own loop
(`drafts.train_heads.train_head`) for --steps steps; lines carry ms per step and tokens per
second. --profile FILE also runs the trainer's default variant under torch.profiler and writes
its kernel table (where a step's time goes).

    python benchmarks/bench_train_step.py [--steps 40] [--token-budgets 32768 16384]
                                          [--algorithms EAGLE3 NEXTN] [--out FILE]
                                          [--profile FILE]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import common

common.add_repo_to_path()

# (name, attention dtype, soft-label k, features on the CPU, head MLP width / the target's,
# how TTT steps after the first attend, whether they run on the answer's window of rows only);
# "bf16-attn+soft16+window" is the trainer's default. (Earlier lines in train_step.jsonl hold
# fp32 attention, hard labels, "diag" and CPU-stored features.)
VARIANTS = (("bf16-attn+soft16", "auto", 16, False, 1, "mask", False),
            ("bf16-attn+soft16+window", "auto", 16, False, 1, "mask", True),
            ("bf16-attn+soft16+window+mlp4x", "auto", 16, False, 4, "mask", True))
DEFAULT_VARIANT = 1
PROMPT_SHARE = 0.55  # of the default data's tokens (4.79M prompt, 3.99M answer)


def synthetic_features(cfg, num_seqs: int, soft_k: int, store, seed: int = 0, width: int = 3):
    """Sequences of chat-like lengths (80-1200 tokens, PROMPT_SHARE prompt), random features
    of `width` hidden states a token (EAGLE3's three aux layers; 1: the final hidden state)."""
    from drafts.train_data import Features

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(80, 1200, (num_seqs,), generator=gen).tolist()
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    n = offsets[-1]
    common_ids = torch.randint(0, cfg.vocab_size, (8192,), generator=gen)
    labels = common_ids[torch.randint(0, 8192, (n,), generator=gen)]
    soft = None
    if soft_k:
        soft = common_ids[torch.randint(0, 8192, (n, soft_k), generator=gen)]
        soft[:, 0] = labels
    logp = torch.log_softmax(torch.randn(n, max(soft_k, 1), generator=gen), -1).sort(
        -1, descending=True).values.half()
    return Features(
        token_ids=labels.roll(1).to(store), labels=labels.to(store),
        hidden=torch.randn(n, width * cfg.hidden_size, generator=gen).bfloat16().to(store),
        offsets=offsets, prompt_lens=[int(n * PROMPT_SHARE) for n in lens],
        soft_ids=soft.to(store) if soft_k else None,
        soft_logp=logp.to(store) if soft_k else None)


def run_variant(target, cfg, device, name, attn_dtype, soft_k, on_cpu, mlp_scale, ttt, window,
                steps, num_seqs, seed, token_budget: int = 16384,
                algorithm: str = "EAGLE3") -> dict:
    from drafts.train_heads import train_head
    from drafts.train_loop import LoopOptions

    store = torch.device("cpu") if on_cpu else device
    feats = synthetic_features(cfg, num_seqs, soft_k, store, seed,
                               width=3 if algorithm == "EAGLE3" else 1)
    split = {"train": list(range(1, num_seqs)), "heldout": [0]}
    opts = LoopOptions(minutes=60.0, max_steps=steps, show_progress=False,
                       token_budget=token_budget)
    with tempfile.TemporaryDirectory() as out:
        record = train_head(algorithm, target, cfg, feats, split, opts, 7, 8192, device, out,
                            attention_dtype=attn_dtype,
                            intermediate_size=mlp_scale * cfg.intermediate_size, ttt=ttt,
                            ttt_window=window)
    tokens = sum(feats.seq_len(i) for i in split["train"]) * record["epochs"]
    line = {"bench": "train_step", "variant": name, "algorithm": algorithm,
            "steps": record["steps"],
            "ms_per_step": 1e3 * record["train_s"] / max(record["steps"], 1),
            "tokens_per_s": tokens / record["train_s"], "ttt_steps": 7,
            "token_budget": opts.token_budget, "ttt": ttt, "ttt_window": window,
            "prompt_share": PROMPT_SHARE, "device": common.device_name(device)}
    print(f"[bench_train_step] {algorithm:6s} {name:28s} {token_budget:6d} tokens a batch "
          f"{line['ms_per_step']:8.1f} ms/step {line['tokens_per_s']:10.0f} tok/s", flush=True)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--num-seqs", type=int, default=400)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "train_step.jsonl"))
    p.add_argument("--token-budgets", type=int, nargs="+", default=[32768],  # the trainer's
                   help="tokens per batch: every variant at the first, the default variant at "
                   "the others too (where host overhead per step stops mattering)")
    p.add_argument("--algorithms", nargs="+", default=["EAGLE3"],
                   help="heads to time: EAGLE3 in every variant, the others in the default one "
                   "(EAGLE and NEXTN draft over the whole vocabulary)")
    p.add_argument("--profile", default=None, help="also write the default variant's kernel "
                   "table under torch.profiler to this file")
    args = p.parse_args()
    from specpcg.models.build import build_model, preset_config

    device = torch.device(args.device)
    cfg = preset_config("shape:smollm2-135m")
    target = build_model(cfg, None, device, torch.bfloat16, seed=0)
    first, *more = args.token_budgets
    lines = [run_variant(target, cfg, device, *v, args.steps, args.num_seqs, seed, first)
             for seed, v in enumerate(VARIANTS)]
    lines += [run_variant(target, cfg, device, *VARIANTS[DEFAULT_VARIANT], args.steps,
                          args.num_seqs, len(lines) + i, budget) for i, budget in enumerate(more)]
    lines += [run_variant(target, cfg, device, *VARIANTS[DEFAULT_VARIANT], args.steps,
                          args.num_seqs, len(lines) + i, first, algorithm=algo)
              for i, algo in enumerate(a for a in args.algorithms if a != "EAGLE3")]
    meta = {"git": common.git_commit(), "time": common.now_iso(), **common.machine_info(device)}
    common.append_jsonl(args.out, [{**line, **meta} for line in lines])
    if args.profile:
        profile_variant(target, cfg, device, args.profile, min(args.steps, 10), args.num_seqs)


def profile_variant(target, cfg, device, path: str, steps: int, num_seqs: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        run_variant(target, cfg, device, *VARIANTS[DEFAULT_VARIANT], steps, num_seqs, seed=99)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90))
    print(f"[bench_train_step] profile of {VARIANTS[DEFAULT_VARIANT][0]} -> {path}", flush=True)


if __name__ == "__main__":
    main()
