"""FlashInfer's decode graphs against its eager decode and Triton's graphs (CUDA, `flashinfer`
installed): one engine each on the default model's shape (random weights), decode tok/s at
batch 1 and 16 (32-token random-id prompts, the same for every engine, 64 new tokens, EOS
ignored; the better of 2 runs after a warm-up), and how many of the 16 greedy outputs equal
Triton's. One JSON line per engine.

    python benchmarks/probe_flashinfer_graphs.py benchmarks/results/flashinfer_graphs.jsonl
"""
import json
import random
import sys

import common

common.add_repo_to_path()
from specpcg import Engine  # noqa: E402

PARAMS = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


def run(backend: str, **kw) -> dict:
    engine = Engine(model_path="shape:smollm2-135m", attention_backend=backend,
                    max_running_requests=16, cuda_graph_max_bs=16, show_progress=False,
                    skip_tokenizer_init=True, **kw)
    graph = engine.get_server_info()["cuda_graph"]
    row = {"backend": backend, **kw, "graph": graph.get("enabled"), "reason": graph.get("reason"),
           **common.machine_info(engine.device)}
    rng = random.Random(0)
    for bs in (1, 16):
        ids = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(bs)]
        engine.generate(input_ids=ids, sampling_params=PARAMS)  # warm-up
        rates = []
        for _ in range(2):
            outs = engine.generate(input_ids=ids, sampling_params=PARAMS)
            rates.append(bs / common.batch_decode([o["meta_info"] for o in outs])["itl_s"])
        row[f"bs{bs}_tok_s"] = round(max(rates))
        row[f"bs{bs}_ids"] = [o["output_ids"] for o in outs]
    engine.shutdown()
    return row


def main(out: str) -> None:
    rows = [run("triton"), run("flashinfer"), run("flashinfer", disable_cuda_graph=True)]
    with open(out, "a") as f:
        for r in rows:
            r["bs16_identical_to_triton"] = sum(
                a == b for a, b in zip(r["bs16_ids"], rows[0]["bs16_ids"]))
            line = {k: v for k, v in r.items() if not k.endswith("_ids")}
            print(line, flush=True)
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(common.RESULTS_DIR / "flashinfer_graphs.jsonl"))
