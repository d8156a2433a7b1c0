"""Where a decoding step's time goes, at batch 1: host time per phase and time waiting on the GPU.

Per system (no-spec, or a draft algorithm at one (steps, topk, draft tokens) setting), a warm
engine decodes --num-questions five-shot GSM8K questions one at a time under cProfile. Each phase
(the draft's proposal, the verify forward, accept, commit, the scheduler's bookkeeping) is the
cumulative wall time of its function per step; `sync_wait` is the time spent in the one
device-to-host copy a step makes (the host waiting for the GPU). A step whose host phases add up
to much more than its GPU work is host-bound: that gap is what CUDA graphs and queued (pinned)
copies remove. `graph_gpu_us` is the GPU time of one replay of each batch-1 graph the step uses
(the floor a step could reach with no host work at all). cProfile itself slows the host, so the
absolute step time here is an upper bound; bench_heads measures speed.

    python benchmarks/bench_step.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_step.py --random-heads --algorithms none,EAGLE   # untrained drafts
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import common

common.add_repo_to_path()
from specpcg import Engine  # noqa: E402
from specpcg.config import TRITON_VERIFY_KERNELS  # noqa: E402
from specpcg.gsm8k import STOP, build_prompts  # noqa: E402
from specpcg.models.loader import default_model_path  # noqa: E402

# (phase, file suffix, function): cumulative time per step.
PHASES = (
    ("step", "specpcg/scheduler.py", "_run_decode"),
    ("propose", "drafts/eagle.py", "propose"),
    ("propose", "drafts/standalone.py", "propose"),
    ("propose", "drafts/ngram.py", "propose"),
    ("verify", "specpcg/speculative/loop.py", "_verify"),
    ("target_forward", "specpcg/router.py", "forward"),
    ("accept", "specpcg/speculative/accept.py", "accept"),
    ("commit", "specpcg/speculative/loop.py", "_commit"),
    ("sample", "specpcg/scheduler.py", "_sample_and_finish"),
    ("append_and_finish", "specpcg/scheduler.py", "_append_and_finish"),
)
SYNC = "<method 'tolist' of 'torch._C.TensorBase' objects>"


def random_head_dir(algo: str, model_path: str) -> str:
    import torch

    from drafts.head_checkpoint import random_head, save_head
    from specpcg.models.build import SHAPE_PREFIX, preset_config
    from specpcg.models.loader import load_checkpoint

    # A shape preset has no checkpoint: the head is shaped for its config.
    cfg = (preset_config(model_path) if model_path.startswith(SHAPE_PREFIX)
           else load_checkpoint(model_path)[0])
    # EAGLE3's own smaller vocabulary, as trained heads have (a tiny test model's is smaller
    # than 8,192: half of it there).
    draft_vocab = min(8192, cfg.vocab_size // 2) if algo == "EAGLE3" else 0
    head, spec = random_head(algo, cfg, "cpu", torch.float32, draft_vocab_size=draft_vocab)
    return save_head(head, spec, cfg, tempfile.mkdtemp(prefix=f"random-{algo}-"))


def draft_path(args, algo: str):
    if algo in ("none", "NGRAM"):
        return None
    if args.random_heads and algo != "STANDALONE":
        return random_head_dir(algo, args.model_path)
    from drafts.train import ensure_draft

    return ensure_draft(algo, target=args.model_path, cache_dir=args.cache_dir)


def phase_times(stats: pstats.Stats, steps: int) -> dict:
    """Microseconds per step of each phase found in the profile (absent phases are left out)."""
    out: dict = {}
    for (path, _, func), (_, _, tottime, cumtime, _) in stats.stats.items():
        for phase, suffix, name in PHASES:
            if func == name and path.endswith(suffix):
                out[phase] = out.get(phase, 0.0) + cumtime / steps * 1e6
        if func == SYNC:
            out["sync_wait"] = out.get("sync_wait", 0.0) + tottime / steps * 1e6
    return {k: round(v, 1) for k, v in out.items()}


def top_functions(stats: pstats.Stats, steps: int, n: int = 25) -> list:
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{path.split('site-packages/')[-1]}:{line}({func})",
             "calls_per_step": round(nc / steps, 2), "tottime_us": round(tt / steps * 1e6, 1)}
            for (path, line, func), (_, nc, tt, _, _) in rows]


def graph_gpu_us(engine, replays: int = 50) -> dict:
    """GPU time of one replay of each batch-1 graph a step uses (the target's decode / verify
    graph, the draft round's catch-up and chain), replayed back to back between CUDA events.
    Run after every request finished: the replays write KV only into free slots."""
    if engine.device.type != "cuda":
        return {}
    return {name: round(common.replay_us(graph, replays), 1)
            for name, graph in batch1_graphs(engine).items()}


def batch1_graphs(engine) -> dict:
    """name -> each batch-1 graph of the target's decode runner (a tree's verify by its key
    count) and of the draft round."""
    graphs = {}
    decode = engine.router.runners.get("decode_graph")
    for (mode, tree_keys, bs), graph in (decode.graphs.items() if decode else ()):
        if bs == 1:
            suffix = f"_tree{tree_keys}" if tree_keys else ""
            graphs[f"target_{mode.name.lower()}{suffix}"] = graph
    rnd = getattr(engine.draft, "round", None)
    for (kind, bs), graph in (rnd.graphs.items() if rnd else ()):
        if bs == 1:
            graphs[f"draft_{kind}"] = graph
    return graphs


def verify_count(engine) -> int:
    return engine.get_server_info()["internal_states"][0].get("spec_verify_ct", 0)


def profile_system(args, algo: str, prompts: list, info: dict) -> dict:
    steps, topk, tokens = args.setting
    kw = dict(model_path=args.model_path, max_total_tokens=args.kv_tokens, max_running_requests=1,
              cuda_graph_max_bs=1, show_progress=False,
              triton_verify_kernel=args.triton_verify_kernel)
    if algo != "none":
        kw.update(speculative_algorithm=algo, speculative_draft_model_path=draft_path(args, algo),
                  speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=tokens, **common.PINNED_SPEC)
    engine = Engine(**kw)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "stop": STOP}
    engine.generate(prompt=prompts[:2], sampling_params=params)  # warm
    before = verify_count(engine)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    outs = [engine.generate(prompt=p, sampling_params=params) for p in prompts]
    profiler.disable()
    seconds = time.perf_counter() - start
    verify = verify_count(engine) - before
    gpu = graph_gpu_us(engine)
    engine.shutdown()
    num_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    num_steps = verify or num_tokens
    stats = pstats.Stats(profiler)
    return {"bench": "step", "system": algo, "setting": list(args.setting) if algo != "none"
            else None, "batch_size": 1, "random_heads": bool(args.random_heads),
            "triton_verify_kernel": args.triton_verify_kernel,
            "num_questions": len(prompts), "output_tokens": num_tokens, "steps": num_steps,
            "tokens_per_step": round(num_tokens / num_steps, 3),
            "step_us": round(seconds / num_steps * 1e6, 1),
            "phases_us": phase_times(stats, num_steps), "graph_gpu_us": gpu,
            "top": top_functions(stats, num_steps),
            **info, "timestamp": common.now_iso()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithms", default="none,EAGLE,EAGLE3")
    p.add_argument("--setting", default="7,1,8", help="steps,topk,draft tokens")
    p.add_argument("--random-heads", action="store_true", help="untrained heads (no training)")
    p.add_argument("--triton-verify-kernel", default="split_k",
                   choices=TRITON_VERIFY_KERNELS)
    p.add_argument("--cache-dir", default=".cache/drafts")
    p.add_argument("--num-questions", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--out", default=str(common.RESULTS_DIR / "step.jsonl"))
    args = p.parse_args(argv)
    args.model_path = args.model_path or default_model_path()
    args.setting = common.parse_setting(args.setting)
    prompts, _ = build_prompts(args.num_questions + 2, 5)
    probe = Engine(model_path=args.model_path, show_progress=False, max_total_tokens=4096)
    info = {**common.machine_info(probe.device), "model": args.model_path}
    probe.shutdown()
    for algo in args.algorithms.split(","):
        rec = profile_system(args, algo, prompts[2:], info)
        common.append_jsonl(args.out, [rec])
        print(algo, rec["step_us"], "us/step", rec["tokens_per_step"], "tokens/step",
              rec["phases_us"])


if __name__ == "__main__":
    main()
