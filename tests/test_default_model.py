"""End to end on the bundled default model (SmolLM2-135M-Instruct GGUF), fp32 on CPU."""

import os

import pytest
import torch

from specpcg import Engine
from specpcg.gsm8k import build_prompts, extract_answer
from specpcg.models.loader import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"]


@pytest.fixture(scope="module")
def engine():
    return Engine(device="cpu", dtype="float32", max_total_tokens=16384)


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def test_greedy_32_tokens_equal_hf_generate(engine, hf_model):
    eos = engine.tokenizer.eos_token_ids[0]
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 32,
                                                               "temperature": 0})
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        if eos in ref:  # HF pads after EOS; we stop there
            ref = ref[:ref.index(eos) + 1]
        assert ours["output_ids"] == ref, prompt
        assert len(ref) >= 16, "a 32-token check that stops early checks little"


def test_gsm8k_batch_of_8_equals_alone(engine):
    prompts, _ = build_prompts(8, num_shots=1)
    params = {"max_new_tokens": 24, "temperature": 0}
    alone = [engine.generate(prompt=p, sampling_params=params)["output_ids"] for p in prompts]
    batched = engine.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in batched] == alone
    assert len({len(engine.tokenizer.encode(p)) for p in prompts}) > 1  # mixed lengths
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]


def test_text_chat_and_stop_string(engine):
    out = engine.generate(messages=[{"role": "user", "content": "Say hello."}],
                          sampling_params={"max_new_tokens": 16, "temperature": 0})
    assert out["text"] and out["meta_info"]["prompt_tokens"] > 10
    free = engine.generate(prompt=PROMPTS[2], sampling_params={"max_new_tokens": 24,
                                                               "temperature": 0})
    word = free["text"].split()[1]
    cut = engine.generate(prompt=PROMPTS[2], sampling_params={"max_new_tokens": 24,
                                                              "temperature": 0, "stop": [word]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in cut["text"] and free["text"].startswith(cut["text"])


def test_extract_answer():
    assert extract_answer(" She has 3 + 5 = 8 apples.\nThe answer is 1,008.\n") == "1008"
    assert extract_answer("no digits") is None
    assert extract_answer("It costs $18.00") == "18.00"
