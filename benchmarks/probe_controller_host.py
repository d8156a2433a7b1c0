"""What the adaptive controller's choices cost the host, batch after batch, on any machine.

An EAGLE3 engine with a random head whose decode steps replay graphs that do nothing
(probe_host_step.graph_engine, "eagle3-adaptive"), so its plain steps are the host's work
alone. Each of --rounds batches of --batch requests (--new-tokens each, EOS ignored) times
every `use_spec` call (probe_adaptive_steps.wrap_use_spec): their sum and count, the calls
over --spike-us (the finish estimate's re-choices and a look's pricing,
`AdaptiveSpeculation._choose` and `_look_due`) and the steps that speculated with what chose
them (a warm-up, a look, a borrowed side after a prefill).
On a CPU the speculative steps run eagerly and slowly; what they cost is not the point, when
they come is.

Prompts of --prompt-lens lengths in turn: with the tiny model's 256 positions, requests of
different prompt lengths end at the context length at different steps, so a batch thins
through smaller buckets at its tail.

    python benchmarks/probe_controller_host.py [--batch 64] [--new-tokens 200] [--rounds 8]
        [--prompt-lens 14] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import common

common.add_repo_to_path()


def round_line(rnd: int, log: list, wall: float, outs: list, spike_us: float) -> dict:
    """One batch's line from probe_adaptive_steps.wrap_use_spec's entries."""
    spikes = [e["us"] for e in log if e["us"] > spike_us]
    return {"probe": "controller_host", "round": rnd, "wall_s": round(wall, 4),
            "plain_tokens": sum(o["meta_info"].get("plain_decode_tokens", 0) for o in outs),
            "use_spec_calls": len(log), "use_spec_us": round(sum(e["us"] for e in log)),
            "spikes": len(spikes), "spike_us": round(sum(spikes)),
            "spec_steps": [[i, e["bs"]] for i, e in enumerate(log) if e["spec"]],
            "switches": [[i, e["why"]] for i, e in enumerate(log) if e["why"]]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[14])
    p.add_argument("--spike-us", type=float, default=20.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from probe_adaptive_steps import wrap_use_spec
    from probe_host_step import graph_engine
    from tests.tiny_models import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as path:
        save_tiny_checkpoint("llama", path, num_layers=4)  # EAGLE3 reads three layers
        engine = graph_engine(path, args.batch, "eagle3-adaptive")
        lens = args.prompt_lens
        prompts = [[(7 * i + j) % 100 + 3 for j in range(lens[i % len(lens)])]
                   for i in range(args.batch)]
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        log = []
        wrap_use_spec(engine.scheduler.adaptive, log)
        for rnd in range(args.rounds):
            log.clear()
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            line = round_line(rnd, log, time.perf_counter() - t0, outs, args.spike_us)
            line.update(common.machine_info(engine.device))
            print(json.dumps(line), flush=True)
            if args.out:
                common.append_jsonl(args.out, [line])


if __name__ == "__main__":
    main()
