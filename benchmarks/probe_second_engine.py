"""Batches of 8 against decoding alone, after other work in the same process: greedy bf16
outputs of the default model, each prompt alone and then in batches of 8, on an engine made
after what --before names ran in that process. Each --before runs in a process of its own:

- none: nothing (a fresh process);
- engine: an engine of the default model generates, then is dropped;
- hf: the Hugging Face model generates on the device, then is dropped (its memory stays in
  torch's cache);
- engine+hf: both, alternating, as tests/test_cuda_engine.py's greedy test does before its
  batch test (on one H200 at 61dd918 the next engine's first batch of 8 went wrong there);
- engine+hf+emptied: the same, then a collection and torch.cuda.empty_cache(), so the engine's
  memory comes from the driver, not from blocks the earlier work left in torch's cache;
- poison: 10 GiB of 0xFF bytes (NaN as floats) allocated and freed, so the engine's memory comes
  from torch's cache holding them;
- ids: request ids moved on by 4 (the engine+hf case's offset).

One JSON line per --before: identical outputs, the first differing token of each prompt, the
first batched output's head, and how many of the GEMV kernel's arrival counters (shared by every
engine in the process) were nonzero when the engine under test was made (None: never made).
On one H200 at 6fdd2c7, `engine` left 6,912 of 8,192 nonzero and the next engine's batches went
wrong: the counters had been made inside a capture (fixed in c248ae0 and 57e3c6c).

    python benchmarks/probe_second_engine.py [--before none engine hf engine+hf
        engine+hf+emptied poison ids] [--prompts 24] [--tokens 32] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

import common
import hf_reference

common.add_repo_to_path()

BEFORE = ("none", "engine", "hf", "engine+hf", "engine+hf+emptied", "poison", "ids")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "List three primes:",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:")
POISON_BYTES = 10 << 30


def _engine(device: str, **kw):
    from specpcg import Engine

    return Engine(device=device, max_total_tokens=32768, show_progress=False, **kw)


def _run_before(before: str, device: str) -> None:
    """What runs in the process before the engine under test is made."""
    if before == "poison":
        blocks = [torch.full((1 << 30,), 255, dtype=torch.uint8, device=device)
                  for _ in range(POISON_BYTES >> 30)]
        del blocks
    elif before == "ids":
        from specpcg import core

        for _ in range(4):
            next(core._request_ids)
    elif before.startswith(("engine", "hf")):
        _generate_before(before, device)
        if before.endswith("+emptied"):
            gc.collect()
            torch.cuda.empty_cache()


def _generate_before(before: str, device: str) -> None:
    from specpcg.models.loader import default_model_path

    first = _engine(device, dtype="bfloat16") if "engine" in before else None
    hf = (hf_reference.load_hf_model(default_model_path(), torch.device(device), torch.bfloat16)
          if "hf" in before else None)
    for prompt in PROMPTS:  # the greedy test's
        ids = [1, 2, 3] if first is None else first.tokenizer.encode(prompt)
        if first is not None:
            first.generate(input_ids=ids, sampling_params={"max_new_tokens": 32,
                                                           "temperature": 0})
        if hf is not None:
            hf.generate(torch.tensor([ids], device=device), max_new_tokens=32, do_sample=False,
                        eos_token_id=2, pad_token_id=2)
    del first, hf  # no gc.collect: as a test function's locals go


def _arrival_counters_nonzero(device: str):
    """Nonzero arrival counters of the GEMV kernel on `device`, or None where none were made."""
    from kernels.dispatch import HAS_TRITON

    dev = torch.device(device)
    if not (HAS_TRITON and dev.type == "cuda"):
        return None
    from kernels import gemv_triton

    counters = gemv_triton.made_arrival_counters(dev)
    return None if counters is None else int((counters != 0).sum())


def worker(spec: dict) -> dict:
    from specpcg.gsm8k import build_prompts
    from tests.matrix_common import first_divergence

    t0 = time.perf_counter()
    _run_before(spec["before"], spec["device"])
    counters_nonzero = _arrival_counters_nonzero(spec["device"])
    engine = _engine(spec["device"], attention_backend=spec["attention_backend"])
    prompts, _ = build_prompts(spec["prompts"], num_shots=1)
    params = {"max_new_tokens": spec["tokens"], "temperature": 0}
    alone = [engine.generate(prompt=p, sampling_params=params)["output_ids"] for p in prompts]
    batched = [o["output_ids"] for i in range(0, len(prompts), 8)
               for o in engine.generate(prompt=prompts[i:i + 8], sampling_params=params)]
    firsts = [first_divergence(b, a) for a, b in zip(alone, batched)]
    return {"bench": "probe_second_engine", **spec,
            "identical": sum(k is None for k in firsts), "first_difference": firsts,
            "batched_head": batched[0][:8], "alone_head": alone[0][:8],
            "arrival_counters_nonzero": counters_nonzero,
            "wall_s": time.perf_counter() - t0, **common.machine_info(engine.device)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", choices=BEFORE, default=list(BEFORE))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--out", default=None, help="JSON lines file to append to")
    args = ap.parse_args()
    lines = []
    for before in args.before:
        spec = {"before": before, "prompts": args.prompts, "tokens": args.tokens,
                "device": args.device, "attention_backend": args.attention_backend}
        lines.append(common.run_json_worker(__file__, "--worker", spec))
        line = lines[-1]
        print(f"{before}: {line['identical']}/{args.prompts} identical, first differences "
              f"{line['first_difference']}", file=sys.stderr, flush=True)
        print(json.dumps(line), flush=True)
    if args.out:
        common.append_jsonl(args.out, lines)


if __name__ == "__main__":
    main()
