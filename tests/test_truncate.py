"""drafts.truncate: a 2-layer STANDALONE draft cut from the default model (fp32 on CPU)."""

import json

import pytest
from safetensors.torch import load_file

from drafts.truncate import truncate
from specpcg import Engine
from specpcg.gsm8k import build_prompts
from specpcg.models.loader import default_model_path, load_checkpoint


@pytest.fixture(scope="module")
def target():
    return load_checkpoint(default_model_path())  # (ModelConfig, HF-named fp32 state dict)


def test_truncated_draft_keeps_first_layers_and_decodes_losslessly(tmp_path, target):
    target_cfg, target_sd = target
    out = truncate(default_model_path(), 2, str(tmp_path / "draft"))

    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == target_cfg.vocab_size
    assert config["tie_word_embeddings"] == target_cfg.tie_word_embeddings
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    assert layers == {"0", "1"}
    for name in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert tensors[name].equal(target_sd[name]), name
    assert all(tensors[k].equal(target_sd[k]) for k in tensors)
    assert (tmp_path / "draft" / "tokenizer.json").is_file()

    prompt = build_prompts(1, num_shots=1)[0][0]
    params = {"max_new_tokens": 16, "temperature": 0}
    plain = Engine(device="cpu", max_total_tokens=4096, show_progress=False)
    want = plain.generate(prompt=prompt, sampling_params=params)["output_ids"]
    plain.shutdown()
    spec = Engine(device="cpu", max_total_tokens=4096, show_progress=False,
                  speculative_algorithm="STANDALONE", speculative_draft_model_path=out)
    got = spec.generate(prompt=prompt, sampling_params=params)
    assert got["output_ids"] == want and len(want) == 16
    assert got["meta_info"]["spec_verify_ct"] > 0


def test_bad_layer_count_is_refused(tmp_path, target):
    with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 30\]"):
        truncate(default_model_path(), 31, str(tmp_path / "draft"))
