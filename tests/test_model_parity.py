"""Our model's logits equal HF transformers' for tiny random Llama, Qwen2 and Qwen3 (fp32)."""

import pytest
import torch

from specpcg import Engine
from specpcg.core import ForwardMode
from specpcg.batch import make_batch
from specpcg.core import Request, SamplingParams
from tests.tiny_models import save_tiny_checkpoint


def _prefill_logits(engine, ids_list):
    """All-token logits of a one-shot EXTEND over several prompts, through the paged KV cache."""
    reqs = [Request(prompt_ids=ids, params=SamplingParams()) for ids in ids_list]
    for r in reqs:
        r.req_pool_idx = engine.kv_cache.new_request()
        engine.kv_cache.extend(r.req_pool_idx, len(r.prompt_ids))
    batch = make_batch(engine.kv_cache, ForwardMode.EXTEND, reqs, [r.prompt_ids for r in reqs],
                       engine.device)
    batch.return_all_logits = True
    out = engine.runner.forward(batch)
    for r in reqs:
        engine.kv_cache.release(r.req_pool_idx)
    return out.all_logits


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False),
                                        ("qwen3", False)])
def test_logits_match_hf(tmp_path, family, tie):
    hf = save_tiny_checkpoint(family, tmp_path, tie)
    engine = Engine(model_path=str(tmp_path), skip_tokenizer_init=True, device="cpu",
                    dtype="float32", max_total_tokens=512)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 17, 1, 40)]
    ours = _prefill_logits(engine, prompts)
    row = 0
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        diff = (ours[row:row + len(ids)] - ref).abs().max().item()
        assert diff < 1e-4, f"{family}: max abs diff {diff}"
        row += len(ids)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_decode_matches_hf_generate(tmp_path, family):
    hf = save_tiny_checkpoint(family, tmp_path)
    engine = Engine(model_path=str(tmp_path), skip_tokenizer_init=True, device="cpu",
                    dtype="float32", max_total_tokens=512)
    ids = [3, 17, 99, 5, 64, 12]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True})
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out["output_ids"] == ref


def test_hidden_states_per_capture_mode_match_hf(tmp_path):
    from specpcg.core import CaptureHiddenMode

    hf = save_tiny_checkpoint("llama", tmp_path)
    engine = Engine(model_path=str(tmp_path), skip_tokenizer_init=True, device="cpu",
                    dtype="float32", max_total_tokens=512)
    prompts = [[5, 9, 2, 44], [7, 7, 100]]
    with torch.no_grad():
        ref = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]
    for mode in CaptureHiddenMode:
        reqs = [Request(prompt_ids=p, params=SamplingParams()) for p in prompts]
        for r in reqs:
            r.req_pool_idx = engine.kv_cache.new_request()
            engine.kv_cache.extend(r.req_pool_idx, len(r.prompt_ids))
        batch = make_batch(engine.kv_cache, ForwardMode.EXTEND, reqs, prompts, engine.device)
        last = engine.model_config.num_layers  # the last layer's output, before the norm
        batch.capture_hidden_mode, batch.aux_hidden_layers = mode, (0, 1, last)
        out = engine.runner.forward(batch)
        for r in reqs:
            engine.kv_cache.release(r.req_pool_idx)
        if mode == CaptureHiddenMode.NULL:
            assert out.hidden_states is None and out.aux_hidden_states is None
            continue
        # HF hidden_states[-1] is after the final norm; [i] is the input of layer i.
        rows = [h[-1][0] for h in ref] if mode == CaptureHiddenMode.FULL else [h[-1][0, -1:] for h in ref]
        assert torch.allclose(out.hidden_states, torch.cat(rows), atol=1e-5)
        for layer, aux in zip((0, 1), out.aux_hidden_states):
            want = [h[layer][0] if mode == CaptureHiddenMode.FULL else h[layer][0, -1:] for h in ref]
            assert torch.allclose(aux, torch.cat(want), atol=1e-5)
        # The final norm of the last layer's output is HF's last hidden state.
        norm = engine.runner.model.model.norm
        assert torch.allclose(norm(out.aux_hidden_states[2]), torch.cat(rows), atol=1e-5)
