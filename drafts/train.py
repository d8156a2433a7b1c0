"""`python -m drafts.train`: a draft for a target, trained by self-distillation on one GPU.

    python -m drafts.train --algorithm {EAGLE,EAGLE3,NEXTN,STANDALONE} [--target PATH] --out DIR
        [--data sharegpt:0.8,gsm8k:0.15,gsm8k-fewshot:0.05] [--num-prompts N] [--max-turns 2]
        [--max-new-tokens 256] [--minutes 9.75] [--ttt-steps 7] [--draft-vocab-size 16384]
        [--soft-label-k 16] [--head-intermediate-size 0]
        [--aux-layer-ids 1,14,29] [--device auto] [--seed 0]

Pipeline: prompts from the data sources (drafts.data: chat turns through the target's chat
template, plain text as is) -> the target's own greedy answers, turn after turn
(drafts.distill) -> the target's features and greedy labels over each whole sequence (dense
attention, no KV cache) -> a head trained with training-time test as deep as the chains the
engine drafts (EAGLE, EAGLE3, NEXTN: drafts.train_heads) or the target's first layers fine-tuned
(STANDALONE: drafts.train_standalone) -> a checkpoint `Engine(speculative_algorithm=ALG,
speculative_draft_model_path=DIR)` loads, with train_log.json beside it, which carries the
offline accept length of the saved draft on held-out sequences (drafts.offline).
`ensure_draft` caches trained drafts by their options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import torch

from drafts.data import DEFAULT_DATA, check_spec, training_samples
from drafts.distill import FEATURES_ONLY, make_engine, self_distill
from drafts.heads import default_aux_layer_ids
from drafts.offline import (draft_hits, load_draft_model, offline_accept,
                            offline_accept_by_source)
from drafts.train_data import extract_features, heldout_split, shared_answers, source_labels
from drafts.train_loop import LoopOptions, loss_curve
from specpcg.speculative.config import DEFAULT_NUM_STEPS

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
TRAINER_VERSION = 11  # part of ensure_draft's cache key: bump when trained drafts change
# Chains whose offline accept length the log carries: the engine's default and the deepest the
# benchmarks run (7, 1, 8); TTT trains as deep as the deepest.
OFFLINE_CHAIN_STEPS = (DEFAULT_NUM_STEPS, 7)
# What each algorithm reads of the target: its final hidden states, the aux layers' residual
# streams (EAGLE3), or nothing but its greedy labels (STANDALONE).
FEATURES = {"EAGLE": "final", "EAGLE3": "aux", "NEXTN": "final", "STANDALONE": None}
# What the run keeps after the training loop for held-out evaluation, the offline simulation and
# saving: heads took about 3 s of it on the H100, the 4-layer STANDALONE draft 20 s (its run
# ended at 595 s of a 585 s budget with 10 s kept: benchmarks/results/train21).
FINISH_MARGIN_S = {"STANDALONE": 30.0}
DEFAULT_FINISH_MARGIN_S = 10.0


def finish_margin_s(algorithm: str) -> float:
    return FINISH_MARGIN_S.get(algorithm, DEFAULT_FINISH_MARGIN_S)


@dataclass(frozen=True)
class TrainOptions:
    num_prompts: int = 14000
    max_new_tokens: int = 256
    max_turns: int = 2  # chat samples: user turns the target answers in turn
    max_prompt_tokens: int = 1024  # longer prompts are skipped (first turn) or end the chat
    # The whole run's wall clock (under 10 minutes): generation and features first, then the
    # training loop gets what is left, less finish_margin_s for held-out evaluation and saving.
    # On the H100 the default command's head runs took 578-579 s in all (benchmarks/results/
    # train19, train20, train21): about 20 s to spare.
    minutes: float = 9.75
    # Unrolled draft steps trained: as many as the deepest chain drafted (steps past it would
    # read hidden states of a kind never seen in training).
    ttt_steps: int = max(OFFLINE_CHAIN_STEPS)
    # The draft vocabulary of EAGLE3 and EAGLE (own LM heads; 0: EAGLE shares the target's
    # 49,152 rows): the most frequent target ids; a label outside it is never drafted.
    # On the default chat + math data 8192 ids cover 96.3% of held-out labels and 16384 cover
    # 99.2%; in the same budget on the H100, 16384 trained to held-out top-1 0.801 (8192:
    # 0.787), offline accept length 3.65 (3.55) and engine accept length 2.81 / 3.28 / 3.03 on
    # chat / zero-shot / few-shot GSM8K (2.74 / 3.24 / 2.99) at the same speed
    # (benchmarks/results/train13, drafts.jsonl). A chain of 7 drafts stops at the first label
    # outside the vocabulary, so coverage compounds.
    draft_vocab_size: int = 16384
    # EAGLE3: the target layers it fuses; () = SGLang's default (low, middle, high).
    aux_layer_ids: tuple = ()
    num_layers: int = 4  # STANDALONE: the target's first K layers
    # Heads learn the target's top-k next-token distribution (0: its argmax alone).
    soft_label_k: int = 16
    # The head layer's MLP width (0: the target's). At batch 1 a draft step is bound by kernel
    # launches, not by the head's width, so a wider head costs little time there.
    head_intermediate_size: int = 0
    device: str = "auto"
    seed: int = 0
    # Tokens a batch, and the rate for it (Adam: scaled with the square root of the batch).
    # With 16,384 the loop waited on the host: a step took 92 ms on the H100 where its kernels
    # took 63 (benchmarks/results/train_profile_window_h100.txt); twice the tokens cost the host
    # the same launches.
    lr: float = 1.4e-3
    token_budget: int = 32768
    max_epochs: int = 40
    max_steps: Optional[int] = None
    heldout_frac: float = 0.05
    show_progress: bool = True

    @staticmethod
    def from_kwargs(kwargs: dict) -> "TrainOptions":
        from specpcg.config import reject_unknown

        reject_unknown(kwargs, TrainOptions, "training option")
        opts = TrainOptions(**kwargs)
        for name in ("num_prompts", "max_new_tokens", "max_turns", "max_prompt_tokens",
                     "ttt_steps", "draft_vocab_size", "num_layers", "token_budget",
                     "max_epochs"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        aux = opts.aux_layer_ids
        if not isinstance(aux, (tuple, list)) or (aux and (len(set(aux)) != 3 or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in aux))):
            raise ValueError(f"aux_layer_ids must be three distinct layer indices, got {aux!r}")
        opts = replace(opts, aux_layer_ids=tuple(aux))
        for name in ("soft_label_k", "head_intermediate_size"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not opts.minutes > 0 or not 0 <= opts.heldout_frac < 1:
            raise ValueError(f"minutes must be > 0 and heldout_frac in [0, 1), got "
                             f"{opts.minutes!r} and {opts.heldout_frac!r}")
        return opts

    def loop(self, minutes: float) -> LoopOptions:
        return LoopOptions(minutes=minutes, max_epochs=self.max_epochs,
                           max_steps=self.max_steps, lr=self.lr, token_budget=self.token_budget,
                           seed=self.seed, show_progress=self.show_progress)


def _make_engine(target: Optional[str], o: TrainOptions, **overrides):
    return make_engine(target, o.device, **overrides)


def _aux_layer_ids(o: TrainOptions, num_layers: int) -> tuple:
    ids = o.aux_layer_ids or default_aux_layer_ids(num_layers)
    if any(i >= num_layers for i in ids):
        raise ValueError(f"aux_layer_ids {list(ids)} name layers past the target's {num_layers}")
    return tuple(ids)


def _feature_layers(algorithm: str, aux_layer_ids: tuple) -> tuple:
    """The target layers whose *entering* residual stream EAGLE3 reads (layer i's output)."""
    if FEATURES[algorithm] != "aux":
        return ()
    return tuple(sorted(i + 1 for i in aux_layer_ids))


def train_draft(algorithm: str, target: Optional[str] = None, data=DEFAULT_DATA,
                out: Optional[str] = None, *, engine=None, answers_cache: Optional[str] = None,
                **opts) -> str:
    """Trains a draft into `out` and returns it. data: a source spec (drafts.data: a name, a
    .jsonl path or a weighted mixture), or prompts as token-id lists (targets without a
    tokenizer). engine: an Engine on the target to generate with (kept open); by default one is
    made and shut down after generating. answers_cache: a file the target's answers are shared
    through (drafts of one target trained side by side generate once); it must be keyed by
    target, prompts and generation options."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    if not out:
        raise ValueError("out (the output directory) is required")
    o = TrainOptions.from_kwargs(opts)
    cached = bool(answers_cache) and os.path.isfile(answers_cache)
    if not isinstance(data, list):  # a bad source, or one not there, fails before the engine
        check_spec(data, readable=not cached)
    if o.show_progress:
        num = len(data) if isinstance(data, list) else o.num_prompts
        print(f"[drafts.train] {algorithm}: {num} prompts, {o.ttt_steps} TTT steps, "
              f"a budget of {o.minutes:g} minutes (self-distillation and features first, the "
              f"training loop gets the rest)", flush=True)
    torch.manual_seed(o.seed)
    times, t0 = {}, time.perf_counter()
    # Answers cached: the engine only lends its model to the features (FEATURES_ONLY).
    own = engine is None
    engine = engine if engine is not None else _make_engine(
        target, o, **(FEATURES_ONLY if cached else {}))
    target_path = target or engine.config.model_path or _default_target()

    def make():
        samples = data if isinstance(data, list) else training_samples(data, o.num_prompts,
                                                                        o.seed)
        return self_distill(engine, samples, o.max_new_tokens, o.max_turns, o.max_prompt_tokens,
                            o.show_progress)

    seqs = shared_answers(answers_cache, make) if answers_cache else make()
    model, target_cfg, device, dtype = engine.model, engine.model_config, engine.device, engine.dtype
    aux = _aux_layer_ids(o, target_cfg.num_layers)
    if own:
        engine.shutdown()  # frees its KV cache and graphs; `model` stays for the features
    times["generate_s"] = time.perf_counter() - t0
    feats = extract_features(model, seqs, _feature_layers(algorithm, aux),
                             FEATURES[algorithm] is not None, device,
                             show_progress=o.show_progress,
                             soft_k=o.soft_label_k if algorithm != "STANDALONE" else 0)
    times["features_s"] = time.perf_counter() - t0 - times["generate_s"]
    split = heldout_split(feats.num_seqs, o.heldout_frac, o.seed, seqs.groups)
    os.makedirs(out, exist_ok=True)
    loop = o.loop(_loop_minutes(o, time.perf_counter() - t0, finish_margin_s(algorithm)))
    record = _train(algorithm, target_path, model, target_cfg, feats, split, o, loop, device,
                    out, aux)
    times["train_s"] = record.pop("train_s")
    sources = source_labels(seqs)
    record.update(_offline(algorithm, out, model, target_cfg, feats, split, sources, device,
                           dtype))
    times["total_s"] = time.perf_counter() - t0
    record["data"] = data if isinstance(data, str) else "token ids"
    _write_log(out, algorithm, target_path, o, seqs, split, record, times, device)
    return out


def _offline(algorithm, out, model, target_cfg, feats, split, sources, device, dtype) -> dict:
    """The saved draft's chains simulated on the held-out sequences (drafts.offline), loaded
    in the engine's dtype as the engine loads it; overall and per data source."""
    draft = load_draft_model(algorithm, out, model, target_cfg, device, dtype)
    ids = split["heldout"]
    hits = draft_hits(algorithm, draft, feats, ids, max(OFFLINE_CHAIN_STEPS), device)
    lens = [feats.prompt_lens[i] for i in ids]
    chains = offline_accept(hits, lens, OFFLINE_CHAIN_STEPS)
    default = f"{DEFAULT_NUM_STEPS},1,{DEFAULT_NUM_STEPS + 1}"
    return {"offline_accept_length": chains[default]["accept_length"],
            "offline_accept": chains,
            "offline_accept_by_source": offline_accept_by_source(
                hits, lens, [sources[i] for i in ids], OFFLINE_CHAIN_STEPS)}


def _loop_minutes(o: TrainOptions, elapsed_s: float, margin_s: float) -> float:
    """The training loop's share of o.minutes once generation and features took elapsed_s, less
    margin_s for what follows the loop."""
    left_s = o.minutes * 60.0 - elapsed_s - margin_s
    if left_s <= 0:
        raise RuntimeError(f"generation and features took {elapsed_s:.0f} s of the {o.minutes} "
                           f"minute budget (minutes={o.minutes}): raise minutes or lower "
                           f"num_prompts")
    return left_s / 60.0


def _train(algorithm, target_path, model, target_cfg, feats, split, o, loop, device,
           out, aux_layer_ids: tuple) -> dict:
    if algorithm == "STANDALONE":  # a whole model, not a head: its own trainer
        from drafts.train_standalone import train_standalone

        return train_standalone(target_path, feats, split, loop, o.num_layers, device, out)
    from drafts.train_heads import train_head

    return train_head(algorithm, model, target_cfg, feats, split, loop, o.ttt_steps,
                      o.draft_vocab_size, device, out, aux_layer_ids,
                      intermediate_size=o.head_intermediate_size or None)


def _default_target() -> str:
    from specpcg.models.loader import default_model_path

    return default_model_path()


def _write_log(out, algorithm, target_path, o, seqs, split, record, times, device) -> dict:
    losses = record.pop("losses")
    tail = losses[-max(len(losses) // 10, 1):]
    log = {
        "algorithm": algorithm, "target": target_path, "device": str(device),
        "options": asdict(o), "num_sequences": len(seqs.token_ids),
        "num_train_sequences": len(split["train"]), "num_heldout_sequences": len(split["heldout"]),
        "prompt_tokens": sum(seqs.prompt_lens), "answer_tokens": seqs.num_answer_tokens,
        "sequences_by_source": dict(Counter(seqs.sources)),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        **record, "times": times, "loss_curve": loss_curve(losses),
    }
    with open(os.path.join(out, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=1)
    acc = ", ".join(f"step {k + 1} {a:.3f}" for k, a in enumerate(log["heldout_top1"]))
    if "heldout_vocab_coverage" in log:
        acc += f"; draft vocabulary covers {log['heldout_vocab_coverage']:.3f} of held-out labels"
    acc += "; offline accept length: " + ", ".join(
        f"({k}) {r['accept_length']:.2f}" for k, r in log["offline_accept"].items())
    acc += " (by source: " + ", ".join(
        f"{name} " + " / ".join(f"{r['accept_length']:.2f}" for r in chains.values())
        for name, chains in log["offline_accept_by_source"].items()) + ")"
    print(f"[drafts.train] {algorithm}: {log['num_sequences']} sequences "
          f"({log['prompt_tokens']} prompt + {log['answer_tokens']} answer tokens); "
          f"{log['steps']} steps, {log['epochs']:.2f} epochs; loss {log['initial_loss']} -> "
          f"{log['final_loss']}; held-out top-1: {acc or 'n/a'}; times "
          + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f"; wrote {out}", flush=True)
    return log


def ensure_draft(algorithm: str, target: Optional[str] = None, cache_dir: str = ".cache/drafts",
                 data: str = DEFAULT_DATA, **opts) -> str:
    """The cached draft trained with these options, training it on a miss. The cache key (in the
    directory's manifest.json) holds everything that changes the weights; device and progress
    bars do not."""
    o = TrainOptions.from_kwargs(opts)
    key = cache_key(algorithm, target, data, o)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"{algorithm.lower()}-{digest}")
    manifest = os.path.join(path, "manifest.json")
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            if json.load(f).get("key") == key:
                return path
    tmp = f"{path}.tmp{os.getpid()}"  # trained aside, then moved: a crash leaves no half draft
    shutil.rmtree(tmp, ignore_errors=True)
    train_draft(algorithm, target, data, tmp, answers_cache=_answers_path(cache_dir, key, o),
                **opts)
    with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump({"key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def cache_key(algorithm: str, target: Optional[str], data: str, o: TrainOptions) -> dict:
    """ensure_draft's key, as its manifest reads back (tuples become lists). Target and data go
    in by content, not by path: a cache copied beside a moved checkout still hits."""
    options = {k: v for k, v in asdict(o).items() if k not in ("device", "show_progress")}
    key = {"algorithm": algorithm, "target": fingerprint(target or _default_target()),
           "data": data_fingerprint(data), "options": options, "version": TRAINER_VERSION}
    return json.loads(json.dumps(key))


FINGERPRINT_BYTES = 1 << 24


def data_fingerprint(data: str) -> list:
    """Each source of a data spec with its weight; paths by content (fingerprint)."""
    from drafts.data.mixture import parse_mixture

    return [[fingerprint(name), weight] for name, weight in parse_mixture(data)]


def fingerprint(path: str) -> dict:
    """A file or checkpoint directory by its files' names, sizes and a hash of each one's first
    FINGERPRINT_BYTES (enough to tell checkpoints apart without reading 16 GB). Names that are
    no path ("shape:llama-3-8b") stand for themselves."""
    root = Path(path)
    if not root.exists():
        return {"name": path}
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
    entries = []
    for f in files:
        with open(f, "rb") as fh:
            head = hashlib.sha256(fh.read(FINGERPRINT_BYTES)).hexdigest()[:16]
        name = f.relative_to(root).as_posix() if root.is_dir() else f.name
        entries.append([name, f.stat().st_size, head])
    return {"files": entries}


def _answers_path(cache_dir: str, key: dict, o: TrainOptions) -> str:
    """Where drafts of one target share its answers: keyed by what changes them."""
    answers = {"target": key["target"], "data": key["data"], "version": TRAINER_VERSION,
               **{k: getattr(o, k) for k in ("num_prompts", "max_new_tokens", "max_turns",
                                             "max_prompt_tokens", "seed")}}
    digest = hashlib.sha256(json.dumps(answers, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"answers-{digest}.pt")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--target", default=None, help="HF dir or .gguf (default: the bundled model)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="gsm8k, gsm8k-fewshot, sharegpt, a .jsonl path (ShareGPT "
                        "'conversations' or OpenAI 'messages' rows), or a weighted mixture "
                        f"(default {DEFAULT_DATA})")
    p.add_argument("--out", default=None,
                   help="output directory (default: a cache under --cache-dir, keyed by the "
                        "options; a second run with the same options trains nothing)")
    p.add_argument("--cache-dir", default=".cache/drafts")
    for f in fields(TrainOptions):
        if f.name == "show_progress":
            continue
        kind = type(f.default) if f.default is not None else int
        if kind is tuple:  # a comma list of ints, e.g. --aux-layer-ids 1,14,29
            kind = lambda v: tuple(int(x) for x in v.split(",") if x)  # noqa: E731
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = vars(p.parse_args(argv))
    opts = {f.name: args[f.name] for f in fields(TrainOptions) if f.name in args}
    opts["show_progress"] = not args["no_progress"]
    if args["out"]:
        path = train_draft(args["algorithm"], args["target"], args["data"], args["out"], **opts)
    else:
        path = ensure_draft(args["algorithm"], args["target"], args["cache_dir"], args["data"],
                            **opts)
    print(f"[drafts.train] draft ready: {path}\n  python -m specpcg generate "
          f"--speculative-algorithm {args['algorithm']} --speculative-draft-model-path {path} "
          f"--prompt '...'", flush=True)


if __name__ == "__main__":
    main()
