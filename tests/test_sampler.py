"""Sampling filters, the sampled distribution, and logprobs (output and input tokens)."""

import pytest
import torch

from specpcg import Engine, SamplingParams
from specpcg.core import Request
from specpcg.sampler import filter_probs, sample, target_probs
from tests.tiny_models import save_tiny_checkpoint


def test_top_k_keeps_k_largest():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    out = filter_probs(probs, SamplingParams(top_k=2))
    assert torch.allclose(out, torch.tensor([0, 4 / 7, 0, 3 / 7]))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # sorted: 0.4, 0.3, 0.2, 0.1; mass before each: 0, .4, .7, .9 -> keep while mass before < p
    assert torch.allclose(filter_probs(probs, SamplingParams(top_p=0.7)),
                          torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(filter_probs(probs, SamplingParams(top_p=0.71)),
                          torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]))
    assert torch.allclose(filter_probs(probs, SamplingParams(top_p=0.3)),
                          torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.05, 0.5, 0.2, 0.25])
    out = filter_probs(probs, SamplingParams(min_p=0.45))
    assert torch.allclose(out, torch.tensor([0, 0.5, 0, 0.25]) / 0.75)


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=0.5)),
                          torch.softmax(logits / 0.5, -1))


def _requests(*params) -> list:
    reqs = [Request(prompt_ids=[1], params=p) for p in params]
    for req in reqs:
        req.generator = torch.Generator().manual_seed(0)
    return reqs


def test_a_greedy_batch_takes_the_picks_made_in_the_graph_as_they_are():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    reqs = _requests(SamplingParams(temperature=0), SamplingParams(temperature=0))
    assert sample(logits, reqs).tolist() == [1, 0]
    picks = torch.tensor([1, 0])
    assert sample(logits, reqs, picks) is picks  # no kernel, no copy


def test_a_sampled_row_is_written_into_a_copy_of_the_graphs_picks():
    """The graph's picks are its output buffer: a sampled row must never overwrite them."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [-50.0, -50.0, 50.0]])
    reqs = _requests(SamplingParams(temperature=0), SamplingParams(temperature=1.0))
    picks = torch.tensor([1, 0])  # row 1 as the graph's argmax of some other logits
    out = sample(logits, reqs, picks)
    assert out.tolist() == [1, 2] and picks.tolist() == [1, 0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sampler")
    hf = save_tiny_checkpoint("llama", path)
    engine = Engine(model_path=str(path), skip_tokenizer_init=True, device="cpu",
                    dtype="float32", max_total_tokens=4096, chunked_prefill_size=8)
    return hf, engine


def test_sampled_first_token_follows_target_distribution(tiny):
    hf, engine = tiny
    prompt = [4, 8, 15, 16, 23, 42]
    params = {"max_new_tokens": 1, "temperature": 0.8, "top_k": 20, "ignore_eos": True}
    n = 2000
    outs = engine.generate(input_ids=[prompt] * n,
                           sampling_params=[{**params, "seed": i} for i in range(n)])
    counts = torch.bincount(torch.tensor([o["output_ids"][0] for o in outs]), minlength=128)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    expected = target_probs(logits, SamplingParams(temperature=0.8, top_k=20)) * n
    keep = expected > 5  # chi-square needs enough expected mass per cell
    assert counts[~keep].sum() <= 0.02 * n
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, f"chi2 {chi2:.1f} with {dof} dof"


def test_output_and_input_logprobs_match_hf(tiny):
    hf, engine = tiny
    prompt = list(range(3, 23))  # 20 tokens, prefilled in 8-token chunks
    out = engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=5,
                          sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    full = prompt + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    inp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t in inp] == prompt[5:]
    want = [ref[p - 1, prompt[p]].item() for p in range(5, 20)]
    assert max(abs(a - b) for (a, _), b in zip(inp, want)) < 1e-4
    outp = out["meta_info"]["output_token_logprobs"]
    want_out = [ref[19 + j, full[20 + j]].item() for j in range(3)]
    assert [t for _, t in outp] == out["output_ids"]
    assert max(abs(a - b) for (a, _), b in zip(outp, want_out)) < 1e-4


def test_no_input_logprobs_without_start_len(tiny):
    _, engine = tiny
    out = engine.generate(input_ids=[1, 2, 3], return_logprob=True,
                          sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == out["meta_info"]["completion_tokens"]
