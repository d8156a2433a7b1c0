"""The HTTP server's overhead: streaming clients against the server, and the same load on the
same engine called in-process (Engine.async_generate), in one run.

For each concurrency c (--concurrency), c asyncio clients each send --requests-per-client
streamed completions of --max-tokens tokens (ignore_eos, so every request has the same length)
one after another; spec off and on (--spec NGRAM etc.). The HTTP clients run in a process of
their own, as real clients do; the in-process ones share the engine's. Per (system, spec, c): requests/s,
output tok/s, TTFT and inter-token latency percentiles (p50, p90, p99), and the server's
throughput as a ratio of the in-process one.

    python benchmarks/bench_server.py [--model-path M] [--concurrency 1 8 32 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import common

common.add_repo_to_path()


def percentile(values: list, q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def _summary(ttfts: list, itls: list, tokens: int, requests: int, elapsed: float) -> dict:
    out = {"requests_per_s": requests / elapsed, "output_tok_s": tokens / elapsed}
    for name, vals in (("ttft_s", ttfts), ("itl_s", itls)):
        for q in (0.5, 0.9, 0.99):
            out[f"{name}_p{int(q * 100)}"] = percentile(vals, q)
    return out


async def _timed(chunks, t0: float, ttfts: list, itls: list) -> int:
    first, last, n = None, None, 0
    async for num_tokens in chunks:
        now = time.perf_counter()
        if first is None:
            first = now
            ttfts.append(now - t0)
        elif num_tokens:
            itls.append((now - last) / num_tokens)
        last, n = now, n + num_tokens
    return n


async def _inprocess_stream(engine, ids, params):
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=params,
                                                   stream=True):
        yield len(chunk["delta_ids"])


async def _http_stream(client, url, ids, params):
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    async with client.stream("POST", url + "/generate", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n = len(json.loads(line[6:])["output_ids"])
                yield n - seen
                seen = n


async def _load(make_stream, concurrency: int, per_client: int, ids: list) -> dict:
    ttfts, itls, tokens = [], [], []

    async def client(i):
        for j in range(per_client):
            t0 = time.perf_counter()
            tokens.append(await _timed(make_stream(ids[(i + j) % len(ids)]), t0, ttfts, itls))

    t0 = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return _summary(ttfts, itls, sum(tokens), len(tokens), time.perf_counter() - t0)


def _start_server(engine):
    import uvicorn

    from specpcg.serve.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, "bench"), host="127.0.0.1",
                                        port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}"


async def _http_load(url: str, c: int, per_client: int, ids: list, params: dict) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
            max_connections=c + 4)) as client:
        return await _load(lambda x: _http_stream(client, url, x, params), c, per_client, ids)


def _http_child(conn, *load_args) -> None:
    conn.send(asyncio.run(_http_load(*load_args)))
    conn.close()


def _http_load_elsewhere(*load_args) -> dict:
    """The HTTP clients run in a process of their own, as real clients do: their JSON and
    HTTP work does not compete with the server for its interpreter."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_http_child, args=(child, *load_args), daemon=True)
    proc.start()
    try:
        return parent.recv()
    finally:
        proc.join(timeout=30)


def run_spec(args, spec) -> list:
    from specpcg import Engine

    kw = {"speculative_algorithm": spec} if spec else {}
    engine = Engine(model_path=args.model_path, max_running_requests=max(args.concurrency),
                    show_progress=False, **kw)
    gen = torch_gen(args)
    ids = [gen(i) for i in range(16)]
    params = {"max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    srv, url = _start_server(engine)
    lines = []

    for c in args.concurrency:
        asyncio.run(_load(lambda x: _inprocess_stream(engine, x, params), 1, 1, ids))  # warm
        inproc = asyncio.run(_load(lambda x: _inprocess_stream(engine, x, params), c,
                                   args.requests_per_client, ids))
        http = _http_load_elsewhere(url, c, args.requests_per_client, ids, params)
        for system, m in (("in-process", inproc), ("server", http)):
            lines.append({"bench": "server", "system": system, "spec": spec or "none",
                          "concurrency": c, "max_tokens": args.max_tokens,
                          "requests": c * args.requests_per_client, **m,
                          "server_over_inprocess": http["output_tok_s"] / inproc["output_tok_s"],
                          **common.machine_info(engine.device)})
            print(f"[bench_server] spec={spec or 'none'} c={c} {system}: "
                  f"{m['output_tok_s']:.0f} tok/s, ttft p50 {m['ttft_s_p50'] * 1e3:.1f} ms, "
                  f"itl p50 {(m['itl_s_p50'] or 0) * 1e3:.2f} ms", flush=True)
    srv.should_exit = True
    engine.shutdown()
    return lines


def torch_gen(args):
    import torch

    g = torch.Generator().manual_seed(0)
    return lambda i: torch.randint(100, 20000, (args.prompt_len,), generator=g).tolist()


def render_table(records: list) -> str:
    rows = [r for r in records if r.get("bench") == "server"]
    cols = ["spec", "concurrency", "system", "output_tok_s", "requests_per_s", "ttft_s_p50",
            "ttft_s_p99", "itl_s_p50", "itl_s_p99", "server_over_inprocess"]
    return common.markdown_table(cols, [[common.fmt(r[c]) if isinstance(r[c], float) else
                                         str(r[c]) for c in cols] for r in rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--spec", nargs="+", default=["none", "NGRAM"])
    p.add_argument("--out", default=str(common.RESULTS_DIR / "server.jsonl"))
    a = p.parse_args(argv)
    for spec in a.spec:
        common.append_jsonl(a.out, run_spec(a, None if spec == "none" else spec))
    print(render_table(common.read_jsonl(a.out)))


if __name__ == "__main__":
    main()
