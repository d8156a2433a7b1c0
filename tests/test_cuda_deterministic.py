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
CELLS = [(algo, pcg) for algo in ("NGRAM", "EAGLE3") for pcg in (True, False)]


def _prompts(engine) -> list:
    from drafts.data import heldout_samples
    from drafts.distill import first_prompts

    return first_prompts(heldout_samples("gsm8k", NUM_PROMPTS), engine.tokenizer, NUM_PROMPTS)


def _engine(deterministic: bool, algo=None, pcg=True) -> Engine:
    kw = {}
    if algo == "EAGLE3":
        from drafts.train import ensure_draft

        kw = dict(speculative_draft_model_path=ensure_draft("EAGLE3"), speculative_num_steps=7,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=8)
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
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps(cell) + "\n")


@pytest.mark.parametrize("algo,pcg", CELLS)
def test_tokens_do_not_depend_on_the_batch(reference, algo, pcg):
    deterministic, prompts, solo, batched = reference
    engine = _engine(deterministic, algo, pcg)
    spec_solo, spec_batched = _outputs(engine, prompts, False), _outputs(engine, prompts, True)
    engine.shutdown()
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    cell = {"bench": "deterministic", "deterministic": deterministic, "algorithm": algo,
            "pcg": pcg, "num_prompts": len(prompts),
            "no_spec_batched_vs_solo": same(batched, solo),
            "spec_solo_vs_no_spec_solo": same(spec_solo, solo),
            "spec_batched_vs_no_spec_batched": same(spec_batched, batched),
            "spec_batched_vs_spec_solo": same(spec_batched, spec_solo)}
    _record(cell)
    if deterministic:
        assert all(v == len(prompts) for k, v in cell.items() if k.endswith("solo")
                   or k.endswith("batched")), cell
