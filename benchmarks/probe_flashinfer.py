"""FlashInfer beside Triton on the default model, one engine each in turn: greedy tokens of four
chat prompts (64 new tokens), decode throughput at batch 1 / 16 / 64 (32-token random-id
prompts, 128 new tokens, EOS ignored) and time to first token at 128 and 512 tokens (median of
3 after a warm-up). One JSON line per backend, then how many outputs were identical.

    python benchmarks/probe_flashinfer.py benchmarks/results/flashinfer_probe_h100.jsonl
"""
import json
import random
import sys
import time

import torch

from specpcg import Engine


def timed(engine, ids, new):
    p = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params=p)
    ts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params=p)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[1]


def main(out_path):
    rng = random.Random(0)
    prompts = ["Explain why the sky is blue.", "Write a haiku about rain.",
               "What is 17 * 23?", "List three uses of copper."]
    outs = {}
    with open(out_path, "w") as f:
        for backend in ("triton", "flashinfer"):
            e = Engine(attention_backend=backend, show_progress=False)
            got = e.generate(prompt=prompts, sampling_params={"max_new_tokens": 64,
                                                              "temperature": 0})
            outs[backend] = [o["output_ids"] for o in got]
            rec = {"backend": backend, "device": torch.cuda.get_device_name(),
                   "info": {k: e.get_server_info()[k] for k in ("attention_backend",)}}
            for bs in (1, 16, 64):
                ids = [[rng.randrange(100, 30000) for _ in range(32)] for _ in range(bs)]
                rec[f"decode_bs{bs}_tok_s"] = bs * 128 / timed(e, ids, 128)
            for n in (128, 512):
                ids = [[rng.randrange(100, 30000) for _ in range(n)]]
                rec[f"ttft_{n}_ms"] = 1e3 * timed(e, ids, 1)
            e.shutdown()
            f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
        same = sum(a == b for a, b in zip(outs["triton"], outs["flashinfer"]))
        f.write(json.dumps({"identical_outputs": same, "of": len(prompts)}) + "\n")
        print("identical outputs", same, "of", len(prompts))


if __name__ == "__main__":
    main(sys.argv[1])
