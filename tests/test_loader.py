"""Checkpoint loading (HF safetensors dirs, GGUF files) and the tokenizer wrapper."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from specpcg.models.loader import default_model_path, load_checkpoint
from specpcg.tokenizer import load_tokenizer

TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def _random_model(model_cls, config):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # Norm weights start at ones and biases at zeros; randomise so a misplaced tensor shows.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def _expected_state_dict(model, tied: bool) -> dict:
    expected = dict(model.state_dict())
    if tied:
        expected.pop("lm_head.weight")
    return expected


def _assert_same_tensors(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].float(), tensor.float()), name


HF_CASES = {
    "llama-tied": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=True), None),
    "llama-untied": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=False), None),
    "qwen2-bias-sharded": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=False), "40KB"),
    "qwen3-qknorm": (Qwen3ForCausalLM, Qwen3Config,
                     dict(tie_word_embeddings=True, head_dim=32), None),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_directory_round_trip(tmp_path, case):
    model_cls, config_cls, extra, shard_size = HF_CASES[case]
    model = _random_model(model_cls, config_cls(**TINY_SHAPE, **extra))
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(tmp_path, **save_kwargs)
    if shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()

    cfg, state_dict = load_checkpoint(str(tmp_path))

    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 96)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 2, 128)
    assert cfg.head_dim == extra.get("head_dim", 16)
    assert cfg.tie_word_embeddings == extra["tie_word_embeddings"]
    assert cfg.attention_bias == (model_cls is Qwen2ForCausalLM)
    assert cfg.qk_norm == (model_cls is Qwen3ForCausalLM)
    assert cfg.architecture == model_cls.__name__
    _assert_same_tensors(state_dict, _expected_state_dict(model, extra["tie_word_embeddings"]))


# ---- GGUF -------------------------------------------------------------------------------------

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer_id, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer_id}.{GGUF_NAMES[module]}.{kind}"


def _interleave_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What the llama GGUF converter does to q/k rows: per head, half-split -> interleaved."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_gguf(path, arch: str, model, cfg, tied: bool):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_rope_freq_base(TINY_SHAPE["rope_theta"])  # HF 5 keeps it in rope_parameters
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    for name, tensor in _expected_state_dict(model, tied).items():
        array = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _interleave_rope_rows(array, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _interleave_rope_rows(array, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_CASES = {
    "llama-untied": ("llama", LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", Qwen3ForCausalLM, Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_round_trip_undoes_rope_permutation(tmp_path, case):
    arch, model_cls, config_cls, extra = GGUF_CASES[case]
    hf_cfg = config_cls(**TINY_SHAPE, **extra)
    model = _random_model(model_cls, hf_cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, model, hf_cfg, extra["tie_word_embeddings"])

    cfg, state_dict = load_checkpoint(str(path))

    assert cfg.architecture == model_cls.__name__
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 96)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, hf_cfg.head_dim)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (128, 256)
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (1e-6, 10000.0)
    assert cfg.tie_word_embeddings == extra["tie_word_embeddings"]
    assert cfg.qk_norm == (arch == "qwen3")
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2, 3))
    _assert_same_tensors(state_dict, _expected_state_dict(model, extra["tie_word_embeddings"]))


# ---- the default model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_checkpoint():
    return load_checkpoint(default_model_path())


def test_default_model_config(default_checkpoint):
    cfg, state_dict = default_checkpoint
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state_dict
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in state_dict.values())


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers' GGUF model loading needs accelerate")
def test_default_model_matches_transformers_gguf_loading(default_checkpoint):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = default_model_path()
    hf_logging.disable_progress_bar()
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    expected = hf_model.state_dict()
    _, state_dict = default_checkpoint
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.17.self_attn.q_proj.weight",
                 "model.layers.5.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(state_dict[name], expected[name].float(), atol=1e-6, rtol=0)


# ---- errors -----------------------------------------------------------------------------------

def _assert_refused(model_path, match: str):
    with pytest.raises(ValueError, match=match) as info:
        load_checkpoint(str(model_path))
    assert "model_path" in str(info.value) and str(model_path) in str(info.value)


def test_missing_path_is_refused(tmp_path):
    _assert_refused(tmp_path / "nope", "does not exist")


def test_empty_dir_is_refused(tmp_path):
    _assert_refused(tmp_path, "without config.json")


def test_dir_without_weights_is_refused(tmp_path):
    LlamaConfig(**TINY_SHAPE).save_pretrained(tmp_path)
    _assert_refused(tmp_path, "no \\*.safetensors")


def test_unsupported_hf_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "hidden_size": 64}))
    _assert_refused(tmp_path, "GPT2LMHeadModel")


def test_truncated_gguf_is_refused(tmp_path):
    hf_cfg = LlamaConfig(**TINY_SHAPE)
    full = tmp_path / "full.gguf"
    _write_gguf(full, "llama", _random_model(LlamaForCausalLM, hf_cfg), hf_cfg, tied=False)
    data = full.read_bytes()
    for cut_len in (10, 600, len(data) // 2, len(data) - 16):
        truncated = tmp_path / f"cut{cut_len}.gguf"
        truncated.write_bytes(data[:cut_len])
        _assert_refused(truncated, "corrupt or truncated")


def test_non_gguf_bytes_are_refused(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file" * 8)
    _assert_refused(path, "not a GGUF file")


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_refused(path, "'gemma' is not supported")


# ---- tokenizer --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer(default_model_path())


def test_tokenizer_round_trip(default_tokenizer):
    text = "Speculative decoding, 3 drafts: accept or reject!"
    ids = default_tokenizer.encode(text)
    assert ids and all(0 <= i < default_tokenizer.vocab_size for i in ids)
    assert default_tokenizer.decode(ids) == text
    assert default_tokenizer.vocab_size == 49152
    assert default_tokenizer.eos_token_ids == (2,)


def test_tokenizer_chat_template(default_tokenizer):
    assert default_tokenizer.has_chat_template
    ids = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    header = default_tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(header):] == header
    assert "What is 2+2?" in default_tokenizer.decode(ids)


def test_batch_tokenizing_gives_each_calls_ids(default_tokenizer):
    """The trainer tokenizes its first prompts in batches: the ids must be those of one call
    each (the chat template writes its own special tokens: the batch adds none)."""
    texts = ["Question: 2 + 2?\nAnswer:", "", "Ünïcödé and  spaces\n\n", "x" * 300]
    assert default_tokenizer.encode_many(texts) == [default_tokenizer.encode(t) for t in texts]
    chats = [[{"role": "user", "content": t}] for t in texts if t] + [[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]]
    assert default_tokenizer.apply_chat_template_many(chats) == [
        default_tokenizer.apply_chat_template(c) for c in chats]
    assert default_tokenizer.encode_many([]) == [] == default_tokenizer.apply_chat_template_many(
        [])


def test_tokenizer_without_template_refuses_messages(default_tokenizer):
    bare = copy.copy(default_tokenizer)
    bare.hf_tokenizer = copy.copy(default_tokenizer.hf_tokenizer)
    bare.hf_tokenizer.chat_template = None
    assert not bare.has_chat_template
    with pytest.raises(ValueError, match="chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_missing_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        load_tokenizer(str(tmp_path / "nope"))
