"""Our decode against a compiled static-cache peer (gpt-fast style: benchmarks/static_ref.py,
torch.compile mode="reduce-overhead") on the same weights, in one process, and against the
copy-bandwidth bound at batch 1.

For each model (the default model; shape:llama-3-8b with random weights unless --skip-8b) and
batch size (--batches): specpcg's decode tok/s (greedy, EOS ignored, --new-tokens after a
--prompt-len prompt; decode time = e2e - TTFT of the batch's slowest request) and the peer's
(the same number of steps after its own prefill), medians of --repeats; ratio = ours / peer.
Bound: batch 1 can be no faster than reading every weight once per token, at the bandwidth a
device-to-device copy reaches here.

    python benchmarks/bench_reference.py [--batches 1 8] [--skip-8b] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch

import common

common.add_repo_to_path()


def copy_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    common.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    common.synchronize(device)
    return 2 * 5 * src.numel() / (time.perf_counter() - t0)


def bytes_read_per_token(model, total: int) -> int:
    """Weight bytes a decode step must read of the `total` the model holds: every weight, but
    of an untied embedding table only its one row (a tied one is the LM head, read whole). The
    copy bandwidth counts read and written bytes alike, so this is compared with it directly."""
    if model.config.tie_word_embeddings:
        return total
    table = model.model.embed_tokens.weight
    return total - table.numel() * table.element_size()


def ours(engine, ids: list, num_new: int) -> float:
    metas = common.generate_ids(engine, ids, num_new)
    decode_s = max(m["e2e_latency"] - m["ttft"] for m in metas)
    return len(ids) * (num_new - 1) / decode_s


def make_peer(model, batch_size: int, max_len: int, step):
    """The compiled static-cache peer, built once per model and batch size and reused by every
    timed run (each run rewrites its cache from position 0)."""
    from static_ref import StaticCacheDecoder

    ref = StaticCacheDecoder(model, batch_size, max_len)
    if step is not None:
        ref.forward = step.__get__(ref)
    return ref


def peer(ref, ids: list, num_new: int) -> float:
    """Decode tok/s of the peer after its own prefill (its cache is rewritten from position 0)."""
    tokens = ref.prefill(ids).argmax(-1)
    pos = torch.full((len(ids),), len(ids[0]), device=tokens.device)
    common.synchronize(tokens.device)
    t0 = time.perf_counter()
    for _ in range(num_new - 1):
        tokens = ref(tokens, pos).argmax(-1)
        pos = pos + 1
    common.synchronize(tokens.device)
    return len(ids) * (num_new - 1) / (time.perf_counter() - t0)


def run(args) -> list:
    from specpcg import Engine
    from static_ref import StaticCacheDecoder

    compiled = torch.compile(StaticCacheDecoder.forward, mode="reduce-overhead") \
        if not args.no_compile else None
    lines = []
    models = [] if args.only_8b else [args.model_path]
    for model_path in models + ([] if args.skip_8b else ["shape:llama-3-8b"]):
        # Half the free memory, not 0.8: the compiled peer needs room of its own beside it.
        engine = Engine(model_path=model_path, max_running_requests=max(args.batches),
                        show_progress=False, mem_fraction_static=0.5)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        read_bytes = bytes_read_per_token(engine.model, weight_bytes)
        bw = copy_bandwidth(engine.device) if engine.device.type == "cuda" else None
        gen = torch.Generator().manual_seed(0)
        for bs in args.batches:
            ids = [torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(bs)]
            # Ours first, then the peer. At 136acb5 our next forward after the compiled peer
            # faulted on the 8B shape: the peer's CUDA graphs drop torch's cached cuBLAS
            # workspaces, one of which our graphs wrote; each capture now allocates its own
            # (breakable.own_cublas_workspace).
            ours(engine, ids, 8)  # warm-up
            a = common.median([ours(engine, ids, args.new_tokens) for _ in range(args.repeats)])
            # The peer's compile and capture run here (the 8B shape's batch 8 had not ended in a
            # 200 s call, H200, e8752dc): a call cut off there says so in its log.
            print(f"[bench_reference] {model_path or 'default'} bs={bs}: specpcg {a:.0f} tok/s; "
                  f"building the peer", flush=True)
            t0 = time.perf_counter()
            ref = make_peer(engine.model, bs, args.prompt_len + args.new_tokens + 8, compiled)
            peer(ref, ids, 8)  # compile, warm-up
            print(f"[bench_reference] the peer built and warmed in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            b = common.median([peer(ref, ids, args.new_tokens) for _ in range(args.repeats)])
            del ref
            line = {"bench": "reference", "model": model_path or "default", "batch": bs,
                    "specpcg_tok_s": a, "static_compiled_tok_s": b, "ratio": a / b,
                    "weight_bytes": weight_bytes, "read_bytes_per_token": read_bytes,
                    "copy_bandwidth_Bps": bw,
                    **common.machine_info(engine.device)}
            if bw and bs == 1:
                bound = bw / read_bytes  # reading each weight once per token
                line.update(bandwidth_bound_tok_s=bound, specpcg_share_of_bound=a / bound)
            lines.append(line)
            common.append_jsonl(args.out, [line])  # as it goes: a later model may time out
            print(f"[bench_reference] {line['model']} bs={bs}: specpcg {a:.0f} tok/s, "
                  f"peer {b:.0f} tok/s, ratio {a / b:.2f}", flush=True)
        engine.shutdown()
    return lines


def bound_share(line: dict):
    """Our batch-1 tok/s over the copy-bandwidth bound, from the line's own fields; None where
    the line predates `read_bytes_per_token` (its stored bound halved the copy's bytes)."""
    bw, read = line.get("copy_bandwidth_Bps"), line.get("read_bytes_per_token")
    if line.get("batch") != 1 or not bw or not read:
        return None
    return line["specpcg_tok_s"] / (bw / read)


def render_table(records: list[dict]) -> str:
    """The latest line per model and batch size."""
    latest = {(r["model"], r["batch"]): r for r in records if r.get("bench") == "reference"}
    cols = [("model", lambda r: r["model"]), ("batch", lambda r: r["batch"]),
            ("git", lambda r: r.get("git")),
            ("specpcg tok/s", lambda r: common.fmt(r["specpcg_tok_s"])),
            ("compiled peer tok/s", lambda r: common.fmt(r["static_compiled_tok_s"])),
            ("ratio", lambda r: f"{r['ratio']:.2f}"),
            ("share of the copy-bandwidth bound", lambda r: common.fmt(bound_share(r)))]
    return common.column_table(list(latest.values()), cols)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--only-8b", action="store_true", help="the 8B shape alone")
    p.add_argument("--no-compile", action="store_true", help="the peer eager (CPU smoke)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "reference.jsonl"))
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
