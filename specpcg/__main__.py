"""Command line: `python -m specpcg generate ...`, `python -m specpcg gsm8k ...` and
`python -m specpcg serve ...` (OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import json
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--speculative-algorithm", default=None,
                   help="EAGLE, EAGLE3, NEXTN, STANDALONE or NGRAM")
    p.add_argument("--speculative-draft-model-path", default=None,
                   help="a draft checkpoint (python -m drafts.train makes one)")
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel stages")
    p.add_argument("--dist-init-addr", default=None, help="host:port of rank 0")
    p.add_argument("--nnodes", type=int, default=1, help="machines the ranks spread over")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine (0 runs the engine; others run their ranks)")
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--min-prefill-requests", type=int, default=1,
                   help="while a batch decodes, admit new requests only this many at a time "
                        "(offline throughput; 1: at once)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-piecewise-cuda-graph", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels: tokens do not depend on the batch")
    p.add_argument("--disable-adaptive-speculation", action="store_true",
                   help="speculate at every batch size (default: only where it measures faster)")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="a running batch of more requests decodes without speculation")


def _make_engine(args):
    """The engine, on node 0; on another node its ranks run here until node 0 shuts down,
    then the command exits."""
    kwargs = _engine_kwargs(args)
    if args.node_rank > 0:
        from specpcg.config import EngineConfig
        from specpcg.distributed.worker import run_node

        run_node(EngineConfig.from_kwargs(kwargs))
        sys.exit(0)
    from specpcg.engine import Engine

    return Engine(**kwargs)


def _engine_kwargs(args) -> dict:
    names = ("model_path", "device", "dtype", "attention_backend", "speculative_algorithm",
             "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
             "speculative_num_draft_tokens", "max_total_tokens", "disable_cuda_graph",
             "disable_piecewise_cuda_graph", "max_running_requests", "mem_fraction_static",
             "chunked_prefill_size", "min_prefill_requests", "enable_deterministic_inference",
             "tp_size",
             "pp_size", "dist_init_addr", "nnodes", "node_rank", "disable_adaptive_speculation",
             "disable_overlap_schedule", "speculative_disable_by_batch_size")
    return {name: getattr(args, name) for name in names}


def _generate(args) -> None:
    engine = _make_engine(args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    kwargs = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    out = engine.generate(sampling_params=params, **kwargs)
    print(out["text"])
    print(json.dumps(out["meta_info"], default=str), file=sys.stderr)


def _gsm8k(args) -> None:
    from specpcg.gsm8k import evaluate

    engine = _make_engine(args)
    res = evaluate(engine, args.num_questions, args.num_shots, args.max_new_tokens, args.batch_size)
    for i, (pred, gold) in enumerate(zip(res["predictions"], res["golds"])):
        print(f"Q{i}: predicted {pred}  gold {gold}  {'OK' if pred == gold else 'wrong'}")
    summary = {k: v for k, v in res.items() if k not in ("predictions", "golds", "output_ids", "texts")}
    summary["device"] = str(engine.device)
    print(json.dumps(summary, indent=1))
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(summary) + "\n")


# The server's packages (the `serve` extra): module name -> pip name.
SERVE_PACKAGES = {"fastapi": "fastapi", "uvicorn": "uvicorn",
                  "prometheus_client": "prometheus-client"}


def _check_serve_packages() -> None:
    """Refuses `serve` before the engine loads (minutes for a large model) when a package the
    server imports is missing, naming it and how to install it."""
    import importlib.util

    missing = [pip for mod, pip in SERVE_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ValueError(f"serving needs {', '.join(missing)}: pip install {' '.join(missing)} "
                         f"(or pip install -e '.[serve]' in the specpcg checkout)")


def _serve(args) -> None:
    if args.node_rank == 0:  # only node 0 serves
        _check_serve_packages()
    engine = _make_engine(args)  # first: a node other than 0 runs its ranks and exits here
    from specpcg.serve.server import serve

    serve(engine, args.host, args.port, args.served_model_name, args.log_level)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specpcg")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    _engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_generate)
    ev = sub.add_parser("gsm8k", help="few-shot GSM8K accuracy and speed")
    _engine_args(ev)
    ev.add_argument("--num-questions", type=int, default=8)
    ev.add_argument("--num-shots", type=int, default=5)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--output", default=None, help="append the summary as a JSON line")
    ev.set_defaults(func=_gsm8k)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--log-level", default="info")
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: its message, not a traceback
        parser.exit(2, f"python -m specpcg {args.cmd}: error: {exc}\n")


if __name__ == "__main__":
    main()
