"""An engine's next forward after other CUDA-graph work in its process: does it still run?

On one H200 at 136acb5, `bench_reference.py` on the 8B shape faulted (an illegal memory
access) in our batch-8 prefill right after its compiled peer (torch.compile, mode
"reduce-overhead") had run. Each case below runs in a process of its own: an engine (8 new
tokens for one 32-token prompt), then what the case names, then batches of 8 and of 1:

- empty: torch.cuda.empty_cache() (cached blocks go back to the device);
- peer: the compiled static-cache peer of bench_reference.py decodes 8 tokens;
- peer-nopcg: the same with piecewise prefill graphs off.

torch.compile's CUDA graphs drop torch's cached cuBLAS workspaces around each recording; a
graph of ours that kept the warm-up's workspace then writes freed memory. One JSON line per
case: "ok", or the error's first line.

    python benchmarks/probe_compiled_neighbour.py [--model-path shape:llama-3-8b]
        [--cases empty peer peer-nopcg] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import common

common.add_repo_to_path()

CASES = ("empty", "peer", "peer-nopcg")


def run_case(case: str, model_path: str, engine_options=None, compile_peer=True) -> dict:
    """One case in this process (engine_options: more Engine arguments; compile_peer=False runs
    the peer eagerly, for a CPU check of the probe itself)."""
    import torch

    from bench_reference import make_peer, peer
    from specpcg import Engine
    from static_ref import StaticCacheDecoder

    options = {"mem_fraction_static": 0.5, "skip_tokenizer_init": True, **(engine_options or {})}
    if case == "peer-nopcg":
        options["disable_piecewise_cuda_graph"] = True
    engine = Engine(model_path=model_path, max_running_requests=8, show_progress=False,
                    **options)
    gen = torch.Generator().manual_seed(0)
    top = min(20000, engine.model.config.vocab_size)  # random ids, within the vocabulary
    one = [torch.randint(top // 8, top, (32,), generator=gen).tolist()]
    eight = [torch.randint(top // 8, top, (32,), generator=gen).tolist() for _ in range(8)]
    common.generate_ids(engine, one, 8)
    if case == "empty":
        torch.cuda.empty_cache()
    else:
        step = (torch.compile(StaticCacheDecoder.forward, mode="reduce-overhead")
                if compile_peer else None)
        ref = make_peer(engine.model, 1, 32 + 16, step)
        peer(ref, one, 8)
        del ref
    out = {"case": case, "model": model_path, **common.machine_info(engine.device)}
    try:
        common.generate_ids(engine, eight, 8)
        common.generate_ids(engine, one, 8)
        out["result"] = "ok"
    except (AssertionError, RuntimeError) as exc:
        out["result"] = str(exc).splitlines()[0][:300]
    if out["result"] == "ok":  # after a fault the device is lost: the process's end frees it
        engine.shutdown()
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:
        spec = json.loads(argv[1])
        print(json.dumps(run_case(spec["case"], spec["model_path"])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="shape:llama-3-8b")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--out", default=str(common.RESULTS_DIR / "compiled_neighbour.jsonl"))
    args = p.parse_args(argv)
    for case in args.cases:
        try:
            line = common.run_json_worker(__file__, "--case",
                                          {"case": case, "model_path": args.model_path})
        except RuntimeError as exc:  # the process died before its line: its error's tail
            line = {"case": case, "model": args.model_path, "result": str(exc)[-300:]}
        common.append_jsonl(args.out, [line])
        print(f"[probe_compiled_neighbour] {case:10} {line['result']}", flush=True)


if __name__ == "__main__":
    main()
