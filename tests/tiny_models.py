"""Tiny random-weight HF models and checkpoints for fast CPU tests."""

from __future__ import annotations

import torch


def tiny_hf_model(family: str, tie: bool = False, seed: int = 0, num_layers: int = 2,
                  heads: tuple = (4, 2)):
    """A random HF transformers model of the given family: llama | qwen2 | qwen3. heads:
    (attention heads, KV heads) over a hidden size of 64."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_layers,
                  num_attention_heads=heads[0], num_key_value_heads=heads[1],
                  max_position_embeddings=256,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF inits biases and norms to constants: randomise them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def save_tiny_checkpoint(family: str, path, tie: bool = False, num_layers: int = 2,
                         heads: tuple = (4, 2)):
    model = tiny_hf_model(family, tie, num_layers=num_layers, heads=heads)
    model.save_pretrained(path)
    return model


def tiny_engine(path, **kw):
    """A CPU fp32 engine on a tiny checkpoint (input ids in, output ids out)."""
    from specpcg import Engine

    kw = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048, **kw}
    return Engine(model_path=path, skip_tokenizer_init=True, **kw)
