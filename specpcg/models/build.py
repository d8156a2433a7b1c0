"""Builds the target model on its device: from a checkpoint, or random weights of any shape."""

from __future__ import annotations

import logging

import torch

from specpcg.models.config import PRESET_SHAPES, ModelConfig
from specpcg.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
SHAPE_PREFIX = "shape:"


def preset_config(model_path: str) -> ModelConfig:
    name = model_path[len(SHAPE_PREFIX):]
    if name not in PRESET_SHAPES:
        raise ValueError(f"model_path {model_path!r}: unknown shape; known: "
                         f"{[SHAPE_PREFIX + k for k in PRESET_SHAPES]}")
    return ModelConfig(**PRESET_SHAPES[name])


def random_init_(model: torch.nn.Module, seed: int) -> None:
    """Small normal weights, unit norms: activations stay finite through any depth."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def empty_model(model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                cls=LlamaForCausalLM):
    """`cls(model_cfg)` with its parameters made in `dtype` on `device` (not initialised)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(model_cfg)
    finally:
        torch.set_default_dtype(old_dtype)


def build_model(model_cfg: ModelConfig, state_dict, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> LlamaForCausalLM:
    """state_dict None means random weights (load_format='dummy' or a shape preset)."""
    model = empty_model(model_cfg, device, dtype)
    if state_dict is None:
        random_init_(model, seed)
    else:
        model.load_weights({k: v.to(dtype) for k, v in state_dict.items()})
    return model.eval().requires_grad_(False)
