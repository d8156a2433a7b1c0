"""Load a single .gguf file: metadata -> ModelConfig, tensors -> HF-named float32 torch tensors.

GGUF keeps quantized blocks; we dequantize everything to float32 on load (the model casts to its
own dtype afterwards). Two layout facts matter:
  * GGML lists a 2-D shape as [in, out]; the row-major data is already HF's [out, in].
  * The llama-architecture converter reorders the rows of q_proj / k_proj inside each head so
    that GGML's interleaved rope (pairs 2i, 2i+1) sees the same rotation HF applies with
    rotate_half (pairs i, i + head_dim/2). Our rope is the rotate_half one, so we undo that.
    qwen2 / qwen3 files use GGML's neox rope and are stored unpermuted.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from specpcg.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"

# GGUF `general.architecture` -> (HF architecture, are q/k rows permuted for interleaved rope?)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")

_REQUIRED = object()  # sentinel: a metadata key the file must have


def open_gguf(model_path: str) -> GGUFReader:
    """A reader over the file, or a ValueError saying why it is not a usable GGUF file."""
    with open(model_path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"model_path={model_path!r} is not a GGUF file: it starts with "
                         f"{magic!r}, not {GGUF_MAGIC!r}")
    try:
        return GGUFReader(model_path)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # GGUFReader parses with numpy views over a memmap; a short file shows up as one of these.
        raise ValueError(f"model_path={model_path!r} is a corrupt or truncated GGUF file "
                         f"({type(exc).__name__}: {exc})") from exc


def _meta(reader: GGUFReader, key: str, model_path: str, default=_REQUIRED):
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"model_path={model_path!r}: GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _float_meta(reader: GGUFReader, key: str, model_path: str, default=_REQUIRED) -> float:
    # GGUF floats are float32: 1e-5 reads back as 9.99999975e-06. Take the shortest decimal that
    # rounds to the same float32, which is the value the HF config.json held.
    return float(str(np.float32(_meta(reader, key, model_path, default))))


def _rope_scaling(reader: GGUFReader, arch: str, model_path: str):
    kind = _meta(reader, f"{arch}.rope.scaling.type", model_path, "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear",
                "factor": _float_meta(reader, f"{arch}.rope.scaling.factor", model_path)}
    raise ValueError(f"model_path={model_path!r}: rope scaling type {kind!r} is not supported "
                     "(supported: none, linear)")


def _eos_token_ids(reader: GGUFReader, model_path: str) -> tuple:
    # End of turn / end of message stop a chat reply just as end of sequence does.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")
    ids = [_meta(reader, k, model_path, None) for k in keys]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def model_config_from_gguf(reader: GGUFReader, model_path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` and `tokenizer.ggml.*` keys)."""
    arch = _meta(reader, "general.architecture", model_path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"model_path={model_path!r}: GGUF architecture {arch!r} is not "
                         f"supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    hf_arch, _ = GGUF_ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"model_path={model_path!r}: per-frequency rope factors "
                         "(rope_freqs.weight, Llama 3.1-style scaling) are not supported")
    hidden_size = int(_meta(reader, f"{arch}.embedding_length", model_path))
    num_heads = int(_meta(reader, f"{arch}.attention.head_count", model_path))
    num_kv_heads = int(_meta(reader, f"{arch}.attention.head_count_kv", model_path, num_heads))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", model_path,
                         hidden_size // num_heads))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else int(
        _meta(reader, f"{arch}.vocab_size", model_path))
    bos = _meta(reader, "tokenizer.ggml.bos_token_id", model_path, None)
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length", model_path)),
        num_layers=int(_meta(reader, f"{arch}.block_count", model_path)),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=_float_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", model_path),
        rope_theta=_float_meta(reader, f"{arch}.rope.freq_base", model_path, 10000.0),
        rope_scaling=_rope_scaling(reader, arch, model_path),
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", model_path, 4096)),
        # No separate output matrix means the LM head reuses the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", architecture=hf_arch,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_token_ids(reader, model_path))


def hf_tensor_name(gguf_name: str, model_path: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, and so on."""
    layer_match = _LAYER_TENSOR.fullmatch(gguf_name)
    if layer_match and layer_match.group(2) in _LAYER_NAMES:
        layer_id, part, kind = layer_match.groups()
        return f"model.layers.{layer_id}.{_LAYER_NAMES[part]}.{kind}"
    global_match = _GLOBAL_TENSOR.fullmatch(gguf_name)
    if global_match and global_match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[global_match.group(1)]}.{global_match.group(2)}"
    raise ValueError(f"model_path={model_path!r}: GGUF tensor {gguf_name!r} has no place in a "
                     "Llama-family model")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's per-head row order [x0, y0, x1, y1, ...] -> [x0, x1, ..., y0, y1, ...].

    Within each head the converter stored HF row (half h, index j) at row 2*j + h.
    """
    num_rows, in_features = weight.shape
    head_dim = num_rows // num_heads
    assert head_dim * num_heads == num_rows and head_dim % 2 == 0, (weight.shape, num_heads)
    per_head = weight.reshape(num_heads, head_dim // 2, 2, in_features)  # [heads, j, h, in]
    return per_head.transpose(1, 2).reshape(num_rows, in_features).contiguous()


def dequantize_tensor(tensor) -> torch.Tensor:
    """A reader tensor as float32 in numpy / HF order (GGML's shape reversed)."""
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # Copy: F32 data is a read-only view of the memmapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def load_gguf_checkpoint(model_path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of a .gguf file; every tensor dequantized to float32."""
    reader = open_gguf(model_path)
    cfg = model_config_from_gguf(reader, model_path)
    _, rope_rows_permuted = GGUF_ARCHITECTURES[_meta(reader, "general.architecture", model_path)]
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, model_path)
        try:
            weight = dequantize_tensor(tensor)
        except (ValueError, NotImplementedError) as exc:
            raise ValueError(f"model_path={model_path!r}: cannot dequantize {tensor.name!r} "
                             f"({tensor.tensor_type.name}): {exc}") from exc
        if rope_rows_permuted and name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, cfg.num_heads)
        elif rope_rows_permuted and name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, cfg.num_kv_heads)
        state_dict[name] = weight
    embed = state_dict.get("model.embed_tokens.weight")
    if embed is None or embed.shape[0] != cfg.vocab_size:
        raise ValueError(f"model_path={model_path!r}: token_embd.weight shape "
                         f"{None if embed is None else tuple(embed.shape)} does not match the "
                         f"tokenizer's {cfg.vocab_size} tokens")
    return cfg, state_dict
