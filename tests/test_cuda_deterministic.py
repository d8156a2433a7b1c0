"""enable_deterministic_inference on the GPU (bf16, `cuda` marker): a request's greedy tokens
are bitwise the same alone or in a batch of 40, with speculative decoding on or off, with
piecewise graphs on or off. The default mode's identity rates are recorded beside them.

40 zero-shot GSM8K test questions through the chat template, 192 tokens. One JSON line per
cell in benchmarks/results/deterministic.jsonl ($SPECPCG_DETERMINISTIC_OUT overrides).
"""

import json
import os

import pytest

from specpcg import Engine

pytestmark = pytest.mark.cuda
NUM_PROMPTS, MAX_NEW_TOKENS = 40, 192
OUT = os.environ.get("SPECPCG_DETERMINISTIC_OUT", "benchmarks/results/deterministic.jsonl")
CHAIN, TREE = (7, 1, 8), (5, 4, 8)
# Chains with piecewise graphs on and off; trees with them on (piecewise graphs change only a
# tree's prefill: its verify replays a tree verify graph, its draft steps run eagerly).
CELLS = [(algo, CHAIN, pcg) for algo in ("NGRAM", "EAGLE3") for pcg in (True, False)] + [
    (algo, TREE, True) for algo in ("NGRAM", "EAGLE3")]


def _prompts(engine) -> list:
    from drafts.data import heldout_samples
    from drafts.distill import first_prompts

    return first_prompts(heldout_samples("gsm8k", NUM_PROMPTS), engine.tokenizer, NUM_PROMPTS)


def _engine(deterministic: bool, algo=None, pcg=True, setting=CHAIN) -> Engine:
    kw = {}
    if algo is not None:
        steps, topk, tokens = setting
        # Pinned: adaptive speculation could run a batch of 40 on plain steps alone.
        kw = dict(speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=tokens, disable_adaptive_speculation=True)
    if algo == "EAGLE3":
        from tests.gpu_drafts import gpu_draft

        kw["speculative_draft_model_path"] = gpu_draft("EAGLE3")
    return Engine(enable_deterministic_inference=deterministic, speculative_algorithm=algo,
                  disable_piecewise_cuda_graph=not pcg, max_running_requests=64,
                  show_progress=False, **kw)


def _outputs(engine, prompts, batched: bool) -> list:
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
    if batched:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                         sampling_params=params)]
    return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]


@pytest.fixture(scope="module", params=[True, False], ids=["deterministic", "default"])
def reference(request):
    engine = _engine(request.param)
    prompts = _prompts(engine)
    solo, batched = _outputs(engine, prompts, False), _outputs(engine, prompts, True)
    engine.shutdown()
    return request.param, prompts, solo, batched


def _record(cell: dict) -> None:
    import torch

    from benchmarks.common import machine_info

    cell = {**cell, **machine_info(torch.device("cuda"))}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps(cell) + "\n")


@pytest.mark.parametrize("algo,setting,pcg", CELLS,
                         ids=[f"{a}-{'tree' if s == TREE else 'chain'}-pcg{int(p)}"
                              for a, s, p in CELLS])
def test_tokens_do_not_depend_on_the_batch(reference, algo, setting, pcg):
    deterministic, prompts, solo, batched = reference
    engine = _engine(deterministic, algo, pcg, setting)
    spec_solo, spec_batched = _outputs(engine, prompts, False), _outputs(engine, prompts, True)
    engine.shutdown()
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    cell = {"bench": "deterministic", "deterministic": deterministic, "algorithm": algo,
            "setting": list(setting), "pcg": pcg, "num_prompts": len(prompts),
            "no_spec_batched_vs_solo": same(batched, solo),
            "spec_solo_vs_no_spec_solo": same(spec_solo, solo),
            "spec_batched_vs_no_spec_batched": same(spec_batched, batched),
            "spec_batched_vs_spec_solo": same(spec_batched, spec_solo)}
    _record(cell)
    if deterministic:
        assert all(v == len(prompts) for k, v in cell.items() if k.endswith("solo")
                   or k.endswith("batched")), cell
