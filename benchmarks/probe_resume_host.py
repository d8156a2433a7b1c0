"""The host's work when a head resumes speculating after plain steps, op by op.

`catch_up_to_paths` runs between the last plain step and the first speculative one, with the
device idle: each op it dispatches costs the dispatcher's time, most of them a kernel launch
on a GPU (a view launches none), and its Python is time the switch costs (probe_switch.py
measures the whole switch on a GPU). This probe counts the ops (aten calls, views included)
it dispatches outside the catch-up's replays, each replay counted as one launch
(a CUDA graph on a GPU; on the CPU its body runs eagerly and is left out of the count and of
the time), and times it the same way, at each batch size. It runs anywhere: the counts are the
device's launches, the times this host's Python and small ops.

On the CPU the overlapped steps need Triton's interpreter (TRITON_INTERPRET=1). The engine is
scripted (probe_switch.py's `script_choices`): --plain plain steps, then --spec
speculative ones, over and over; an untrained head of the --algorithm's kind.

    python benchmarks/probe_resume_host.py [--model-path shape:smollm2-135m] [--algorithm EAGLE3]
        [--batches 1 4 16 64] [--plain 8] [--spec 2] [--max-new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import common

common.add_repo_to_path()


class OpCounter:
    """Counts aten ops while on and not paused; `pause` wraps a call counted as one launch."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter.paused:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.mode, self.ops, self.paused, self.paused_s = _Mode(), 0, False, 0.0

    def pause(self, fn):
        def call(*a, **k):
            if self.paused:
                return fn(*a, **k)
            self.paused, self.ops, start = True, self.ops + 1, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.paused = False
                self.paused_s += time.perf_counter() - start
        return call


def instrument(engine, log: list) -> None:
    """Wraps the draft's catch_up_to_paths: a log line per call (requests, ops, host s)."""
    draft, counter = engine.draft, OpCounter()
    for rnd in (draft.resume.runners if draft.resume is not None else []):
        rnd.catch_up = counter.pause(rnd.catch_up)
    inner = draft.catch_up_to_paths

    def timed(reqs):
        counter.ops, counter.paused_s = 0, 0.0
        start = time.perf_counter()
        with counter.mode:
            out = inner(reqs)
        host_s = time.perf_counter() - start - counter.paused_s
        log.append({"requests": len(reqs), "ops": counter.ops, "host_s": host_s})
        return out
    draft.catch_up_to_paths = timed


def tiny_checkpoint(path) -> None:
    """A random 4-layer Llama (EAGLE3 reads three distinct layers) of hidden size 64."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_theta=10000.0)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)


def make_engine(args):
    """An adaptive engine with an untrained head of --algorithm's kind, Triton attention (an
    overlapped step's bodies need it; on the CPU through the interpreter), on --model-path or
    a tiny random checkpoint (--tiny: the CPU runs it in seconds; the counts do not depend
    on the model's size, only on the batch and the steps)."""
    import tempfile

    from bench_adaptive import engine_kwargs, untrained_drafts
    from specpcg import Engine

    path, extra = args.model_path, {}
    if args.tiny:
        path = tempfile.mkdtemp(prefix="tiny-")
        tiny_checkpoint(path)
        extra = {"device": "cpu", "dtype": "float32", "skip_tokenizer_init": True}
    draft = untrained_drafts([args.algorithm], path)[args.algorithm]
    most = max(args.batches)
    return Engine(model_path=path, show_progress=False, max_running_requests=most,
                  cuda_graph_max_bs=most, attention_backend="triton", **extra,
                  **engine_kwargs("adaptive", args.algorithm, draft,
                                  common.parse_setting(args.setting)))


def run(args) -> list:
    from probe_switch import script_choices

    engine = make_engine(args)
    log, lines = [], []
    instrument(engine, log)
    script_choices(engine, args.plain, args.spec)
    vocab = engine.model_config.vocab_size
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    for bs in args.batches:
        prompts = [[(7 * i + j) % vocab for j in range(args.prompt_len)] for i in range(bs)]
        del log[:]
        engine.generate(input_ids=prompts, sampling_params=params)
        calls = [c for c in log if c["requests"] == bs]
        if not calls:
            continue
        lines.append({"bench": "probe_resume_host", "algorithm": args.algorithm, "batch": bs,
                      "plain": args.plain, "spec": args.spec, "calls": len(calls),
                      "ops_mean": sum(c["ops"] for c in calls) / len(calls),
                      "ops_max": max(c["ops"] for c in calls),
                      "host_ms_median": 1e3 * common.median([c["host_s"] for c in calls]),
                      "resume_graphs": engine.draft.info().get("resume_graphs"),
                      **common.machine_info(engine.device)})
        print(f"[probe_resume_host] bs {bs:3}: {len(calls)} catch-ups, "
              f"{lines[-1]['ops_mean']:.0f} ops, {lines[-1]['host_ms_median']:.2f} ms host "
              f"(median)", flush=True)
    engine.shutdown()
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the bundled model")
    p.add_argument("--tiny", action="store_true", help="a tiny random checkpoint instead")
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--setting", default="3,1,4")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--plain", type=int, default=8)
    p.add_argument("--spec", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = run(args)
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
