"""The Hugging Face reference model the benchmarks compare against: the same weights specpcg
loads, from the GGUF through transformers or, where that fails, built from specpcg's own
loaded checkpoint."""

from __future__ import annotations

import os
import sys

import torch


def load_hf_model(model_path: str, device: torch.device, dtype: torch.dtype):
    """The HF model with the weights specpcg loads: from the GGUF through transformers, or,
    where that fails, a LlamaForCausalLM built from our own loaded config and state dict."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    is_dir = os.path.isdir(model_path)
    directory = model_path if is_dir else os.path.dirname(os.path.abspath(model_path))
    kwargs = {} if is_dir else {"gguf_file": os.path.basename(model_path)}
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    except (ImportError, OSError, ValueError, KeyError, RuntimeError) as exc:
        print(f"HF from_pretrained failed ({type(exc).__name__}: {exc}); building "
              "LlamaForCausalLM from specpcg's loaded checkpoint", file=sys.stderr)
        model = hf_model_from_checkpoint(model_path, dtype)
    return model.to(device).eval()


def hf_model_from_checkpoint(model_path: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpcg.models.loader import load_checkpoint

    cfg, state_dict = load_checkpoint(model_path)
    if cfg.family != "llama":
        raise RuntimeError(f"the fallback builds Llama only, not {cfg.architecture}; install "
                           "accelerate and gguf so transformers can load the checkpoint itself")
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None)
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype)
