"""Load a Hugging Face checkpoint directory: config.json plus safetensors (one file or shards)."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specpcg.models.config import ModelConfig

SHARD_INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"


def load_hf_config(model_path: str) -> ModelConfig:
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model_path={model_path!r} is a directory without config.json; "
                         "expected a Hugging Face checkpoint directory or a .gguf file")
    with open(config_path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model_path={model_path!r}: config.json is not valid JSON "
                             f"({exc})") from exc
    try:
        return ModelConfig.from_hf_dict(cfg)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"model_path={model_path!r}: cannot read config.json: {exc}") from exc


def _weight_files(model_path: str) -> list[str]:
    """The safetensors files holding the weights, in a stable order."""
    index_path = os.path.join(model_path, SHARD_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_path, n))]
        if missing:
            raise ValueError(f"model_path={model_path!r}: {SHARD_INDEX_NAME} lists shards "
                             f"that are not on disk: {missing}")
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, SINGLE_FILE_NAME)
    if os.path.isfile(single):
        return [single]
    # Some exports use other names for a lone file; take every safetensors file there is.
    return sorted(os.path.join(model_path, n) for n in os.listdir(model_path)
                  if n.endswith(".safetensors"))


def _keep_tensor(name: str, cfg: ModelConfig) -> bool:
    # Old Llama exports saved the rotary inverse frequencies; we recompute them.
    if name.endswith("rotary_emb.inv_freq"):
        return False
    # NOTE: with tied embeddings the model has no lm_head parameter; a stale copy must not load.
    return not (cfg.tie_word_embeddings and name == "lm_head.weight")


def load_hf_checkpoint(model_path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of a Hugging Face directory; tensors keep their stored dtype."""
    cfg = load_hf_config(model_path)
    files = _weight_files(model_path)
    if not files:
        raise ValueError(f"model_path={model_path!r} has config.json but no *.safetensors "
                         "weights (pytorch_model.bin checkpoints are not supported)")
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors = load_file(path, device="cpu")
        except SafetensorError as exc:
            raise ValueError(f"model_path={model_path!r}: {os.path.basename(path)} is not a "
                             f"readable safetensors file ({exc})") from exc
        for name, tensor in tensors.items():
            if _keep_tensor(name, cfg):
                state_dict[name] = tensor
    return cfg, state_dict
