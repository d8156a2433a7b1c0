"""Resolves `model_path` / `load_format` into (model, ModelConfig, tokenizer) on a device."""

from __future__ import annotations

import logging

import torch

from specpcg.models.build import SHAPE_PREFIX, build_model, preset_config

logger = logging.getLogger(__name__)


def draft_load_config(cfg, path: str):
    """The engine config `cfg`, set to load a draft model's checkpoint at `path` (its own
    format, no tokenizer: the draft uses the target's)."""
    from dataclasses import replace

    return replace(cfg, model_path=path, load_format="auto", tokenizer_path=None,
                   skip_tokenizer_init=True)


def load_target(cfg, device: torch.device, dtype: torch.dtype):
    """cfg: EngineConfig. Shape presets have no tokenizer (callers pass input_ids)."""
    from specpcg.models.loader import default_model_path, load_checkpoint

    path = cfg.model_path or default_model_path()
    if path.startswith(SHAPE_PREFIX):
        model_cfg = preset_config(path)
        logger.info("building %s with random weights", path)
        return build_model(model_cfg, None, device, dtype, cfg.random_seed), model_cfg, None
    model_cfg, state_dict = load_checkpoint(path)
    if cfg.load_format == "dummy":
        state_dict = None
    tokenizer = None
    if not cfg.skip_tokenizer_init:
        from specpcg.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer_path or path)
    model = build_model(model_cfg, state_dict, device, dtype, cfg.random_seed)
    return model, model_cfg, tokenizer
