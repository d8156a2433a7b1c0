"""A STANDALONE draft cut from its target: the embeddings, the first K decoder layers, the final
norm and the LM head, written as a Hugging Face directory.

The draft shares the target's tokenizer and vocabulary by construction, so
`Engine(speculative_algorithm="STANDALONE", speculative_draft_model_path=OUT)` accepts it, and
transformers loads it too (`AutoModelForCausalLM.from_pretrained(OUT)`, e.g. as an
`assistant_model`). The target may be a Hugging Face directory or a .gguf file (dequantized).

    python -m drafts.truncate --target PATH --num-layers 8 --out DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Optional

import torch

from specpcg.models.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# HF architecture -> the `model_type` transformers dispatches on
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.")
# config.json keys holding one entry per layer (newer transformers): cut to the kept layers
_PER_LAYER_KEYS = ("layer_types",)


def select_layers(state_dict: dict, num_layers: int) -> dict:
    """The parameters of layers < num_layers plus every non-layer one (embeddings, norm, head),
    each contiguous and owning its storage (safetensors refuses shared views)."""
    kept = {}
    for name, tensor in state_dict.items():
        match = _LAYER_PARAM.match(name)
        if match is None or int(match.group(1)) < num_layers:
            kept[name] = tensor.detach().clone().contiguous()
    return kept


def config_from_model_config(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> dict:
    """A config.json for `cfg` cut to `num_layers` layers (targets with no config.json: GGUF)."""
    rope_parameters = {**(cfg.rope_scaling or {"rope_type": "default"}),
                       "rope_theta": cfg.rope_theta}
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": [cfg.architecture], "model_type": MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        # both spellings: transformers >= 5 reads rope_parameters, older ones rope_theta/_scaling
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def config_from_hf_dir(target_path: str, num_layers: int, dtype: torch.dtype) -> dict:
    """The target's own config.json with the layer count (and per-layer lists) cut to K."""
    with open(os.path.join(target_path, CONFIG_NAME), encoding="utf-8") as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    for key in _PER_LAYER_KEYS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    if "max_window_layers" in config:  # Qwen2: layers past this use sliding windows
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    return config


def _cast(state_dict: dict, dtype: Optional[torch.dtype]) -> dict:
    if dtype is None:
        return state_dict
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}


def truncate(target_path: str, num_layers: int, out_dir: str,
             dtype: Optional[torch.dtype] = None, checkpoint: Optional[tuple] = None) -> str:
    """Writes the K-layer draft of `target_path` into `out_dir` (created) and returns it.

    dtype: cast the weights (None keeps the target's: float32 for a dequantized GGUF).
    checkpoint: `load_checkpoint(target_path)` when the caller already holds it (not mutated)."""
    from safetensors.torch import save_file

    from specpcg.models.loader import load_checkpoint
    from specpcg.tokenizer import load_tokenizer

    target_path = os.fspath(target_path)
    cfg, state_dict = checkpoint or load_checkpoint(target_path)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be an integer in [1, {cfg.num_layers}] (the target's "
                         f"layer count), got {num_layers!r}")
    draft = _cast(select_layers(state_dict, num_layers), dtype)
    del state_dict
    weight_dtype = next(v.dtype for k, v in draft.items() if k.endswith("embed_tokens.weight"))
    if os.path.isdir(target_path):
        config = config_from_hf_dir(target_path, num_layers, weight_dtype)
    else:
        config = config_from_model_config(cfg, num_layers, weight_dtype)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(draft, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    load_tokenizer(target_path).hf_tokenizer.save_pretrained(out_dir)
    return out_dir


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    from specpcg.config import DTYPES

    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF dir or .gguf (default: the bundled model)")
    p.add_argument("--num-layers", type=int, required=True, help="decoder layers to keep (K)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--dtype", default="auto", help="cast weights (auto: keep the target's)")
    args = p.parse_args(argv)
    from specpcg.models.loader import default_model_path

    target = args.target or default_model_path()
    out = truncate(target, args.num_layers, args.out, parse_dtype(args.dtype))
    print(f"wrote a {args.num_layers}-layer draft of {target} to {out}")


if __name__ == "__main__":
    main()
