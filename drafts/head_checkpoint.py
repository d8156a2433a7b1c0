"""Draft-head checkpoints in the layouts people publish, read and written.

- EAGLE (EAGLE repository / SGLang `LlamaForCausalLMEagle`): `fc.weight` [H, 2H] (+ `fc.bias`),
  `layers.0.self_attn.{q,k,v,o}_proj`, `layers.0.mlp.*`, `layers.0.post_attention_layernorm`,
  optionally `embed_tokens.weight`, `lm_head.weight`; names may carry a `model.` prefix. An LM
  head over a draft vocabulary (config `draft_vocab_size` rows) comes with `d2t` and `t2d`, as
  EAGLE3's does (what `drafts.train` writes).
- EAGLE3 (SpecForge / SGLang `LlamaForCausalLMEagle3`): `midlayer.*` (q/k/v over 2H inputs,
  `hidden_norm`), `fc.weight` [H, 3H], `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t`,
  `t2d`; config `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`.
- NEXTN (DeepSeek-style): `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,
  shared_head.head,self_attn.*,mlp.*,...}` with L the target's layer count.
"""

from __future__ import annotations

import json
import os
import re

import torch

from drafts.heads import HEAD_ALGORITHMS, HeadSpec, build_head, default_aux_layer_ids
from specpcg.models.config import ModelConfig
from specpcg.models.llama import fuse_projections

ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3",
                 "NEXTN": "LlamaForCausalLMNextN"}
_NEXTN_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")
DRAFT_VOCAB_ALGORITHMS = ("EAGLE", "EAGLE3")  # heads whose own LM head may be a draft vocabulary


def detect_algorithm(config: dict, names) -> str:
    arch = " ".join(config.get("architectures") or [])
    if "Eagle3" in arch or any(n.startswith("midlayer.") for n in names):
        return "EAGLE3"
    if "NextN" in arch or config.get("num_nextn_predict_layers") or any(".enorm." in n for n in names):
        return "NEXTN"
    if "Eagle" in arch or "fc.weight" in names or "model.fc.weight" in names:
        return "EAGLE"
    raise ValueError(f"architectures {config.get('architectures')!r}: not an EAGLE, EAGLE3 or "
                     f"NEXTN draft head")


def _layer_cfg(config: dict) -> ModelConfig:
    plain = {**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    return ModelConfig.from_hf_dict(plain).with_overrides(tie_word_embeddings=False)


def _to_module_names(algorithm: str, state: dict) -> dict:
    """Published names -> this package's head module names (q/k/v and gate/up fused)."""
    out = {}
    for name, tensor in state.items():
        if algorithm == "NEXTN":
            m = _NEXTN_PREFIX.match(name)
            name = name[m.end():] if m else name.removeprefix("model.")
            if name.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                      "post_attention_layernorm"):
                name = "layer." + name
        else:
            name = name.removeprefix("model.")
        out[name] = tensor
    return fuse_projections(out)


def read_spec(path: str, config: dict, state: dict, target_cfg: ModelConfig) -> HeadSpec:
    """The HeadSpec a checkpoint declares, checked against the target it will draft for."""
    algorithm = detect_algorithm(config, state)
    where = f"speculative_draft_model_path {path!r}"
    try:
        layer_cfg = _layer_cfg(config)
    except KeyError as exc:
        raise ValueError(f"{where}: config.json has no {exc} field") from exc
    if layer_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{where}: {algorithm} head hidden_size {layer_cfg.hidden_size} does not "
                         f"match the target's hidden_size {target_cfg.hidden_size}")
    if layer_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{where}: {algorithm} head vocab_size {layer_cfg.vocab_size} does not "
                         f"match the target's vocab_size {target_cfg.vocab_size}")
    aux = ()
    if algorithm == "EAGLE3":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else default_aux_layer_ids(target_cfg.num_layers)
        if len(set(aux)) != 3 or any(not 0 <= i < target_cfg.num_layers for i in aux):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} are not three "
                             f"distinct layers of the {target_cfg.num_layers}-layer target")
    names = set(state)
    return HeadSpec(
        algorithm=algorithm, layer_cfg=layer_cfg,
        draft_vocab_size=(int(config.get("draft_vocab_size") or 0)
                          if algorithm in DRAFT_VOCAB_ALGORITHMS else 0),
        aux_layer_ids=aux, fc_bias="fc.bias" in names,
        has_embed="embed_tokens.weight" in names,
        has_head=algorithm == "EAGLE3" or "lm_head.weight" in names or "shared_head.head.weight" in names)


def load_head(path: str, algorithm: str, target_cfg: ModelConfig, target_model, device, dtype):
    """Loads a head for `target_model`; ValueError naming the path for any mismatch."""
    from specpcg.models.hf_loader import _weight_files, load_file

    config = _read_config(path)
    files = _weight_files(path)
    if not files:
        raise ValueError(f"speculative_draft_model_path {path!r} has no *.safetensors weights")
    raw = {}
    for f in files:
        try:
            raw.update(load_file(f, device="cpu"))
        except Exception as exc:  # safetensors raises several types for a corrupt file
            raise ValueError(f"speculative_draft_model_path {path!r}: {os.path.basename(f)} is "
                             f"not a readable safetensors file ({exc})") from exc
    found = detect_algorithm(config, raw)
    if found != algorithm:
        raise ValueError(f"speculative_draft_model_path {path!r} holds a {found} head, but "
                         f"speculative_algorithm is {algorithm!r}")
    state = _to_module_names(algorithm, raw)
    spec = read_spec(path, config, state, target_cfg)
    head = build_head(spec, device, dtype)
    d2t, _ = state.pop("d2t", None), state.pop("t2d", None)
    _check_shapes(path, algorithm, head, state)
    missing, unexpected = head.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                               strict=False)
    missing = [m for m in missing if not m.endswith("cos_sin")]
    if missing or unexpected:
        raise ValueError(f"speculative_draft_model_path {path!r}: the {algorithm} checkpoint does "
                         f"not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if head.draft_to_target is not None and d2t is None and spec.draft_vocab_size not in (
            0, target_cfg.vocab_size):
        raise ValueError(f"speculative_draft_model_path {path!r}: an {algorithm} head with "
                         f"draft_vocab_size {spec.draft_vocab_size} needs its d2t map")
    if head.draft_to_target is not None and d2t is not None:
        _check_d2t(path, d2t, spec, target_cfg)
        head.set_d2t(d2t.to(device))
    head.attach_target(target_model)
    return head.eval().requires_grad_(False), spec


def _check_shapes(path, algorithm: str, head, state: dict) -> None:
    expected = head.state_dict()
    wrong = [f"{k} {list(v.shape)} (config says {list(expected[k].shape)})"
             for k, v in state.items() if k in expected and v.shape != expected[k].shape]
    if wrong:
        raise ValueError(f"speculative_draft_model_path {path!r}: the {algorithm} checkpoint's "
                         f"tensor shapes do not match its config: {wrong[:5]}")


def _check_d2t(path, d2t, spec: HeadSpec, target_cfg: ModelConfig) -> None:
    vocab = spec.draft_vocab_size or target_cfg.vocab_size
    ids = torch.arange(d2t.shape[0]) + d2t.long()
    if d2t.shape[0] != vocab:
        raise ValueError(f"speculative_draft_model_path {path!r}: d2t has {d2t.shape[0]} entries "
                         f"but draft_vocab_size is {vocab}")
    if ids.min() < 0 or ids.max() >= target_cfg.vocab_size:
        raise ValueError(f"speculative_draft_model_path {path!r}: d2t maps draft ids outside "
                         f"the target's vocabulary of {target_cfg.vocab_size}")


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"speculative_draft_model_path {path!r} is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"speculative_draft_model_path {path!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_draft_model_path {path!r}: config.json is not valid JSON "
                         f"({exc})") from exc


# ---- writing ---------------------------------------------------------------------------------

def head_config(spec: HeadSpec, target_cfg: ModelConfig) -> dict:
    c = spec.layer_cfg
    config = {
        "architectures": [ARCHITECTURES[spec.algorithm]], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if c.rope_scaling:
        config["rope_scaling"] = dict(c.rope_scaling)
    if spec.algorithm == "EAGLE3" or spec.draft_vocab_size:
        config["draft_vocab_size"] = spec.draft_vocab_size or c.vocab_size
    if spec.algorithm == "EAGLE3":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids)}
    if spec.algorithm == "NEXTN":
        config["num_hidden_layers"] = target_cfg.num_layers  # the MTP layer's index in names
        config["num_nextn_predict_layers"] = 1
    return config


def published_state(head, spec: HeadSpec, num_target_layers: int) -> dict:
    """The head's weights under published names: q/k/v and gate/up split again."""
    out = {}
    for name, tensor in head.state_dict().items():
        if name.endswith("cos_sin"):
            continue
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{fused}." in name:
                sizes = _split_sizes(head, fused, tensor)
                for part, piece in zip(parts, tensor.split(sizes, 0)):
                    out[name.replace(fused, part)] = piece
                break
        else:
            out[name] = tensor
    if head.draft_to_target is not None:
        ids = head.draft_to_target.cpu()
        out["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(spec.layer_cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    if spec.algorithm == "NEXTN":
        prefix = f"model.layers.{num_target_layers}."
        out = {prefix + n.removeprefix("layer."): t for n, t in out.items()}
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def _split_sizes(head, fused: str, tensor) -> list:
    c = head.config
    if fused == "qkv_proj":
        return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    return [tensor.shape[0] // 2] * 2


def save_head(head, spec: HeadSpec, target_cfg: ModelConfig, out_dir: str) -> str:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(head_config(spec, target_cfg), f, indent=2)
    save_file(published_state(head, spec, target_cfg.num_layers),
              os.path.join(out_dir, "model.safetensors"))
    return out_dir


def random_head(algorithm: str, target_cfg: ModelConfig, device, dtype, seed: int = 0,
                draft_vocab_size: int = 0, intermediate_size: int | None = None,
                aux_layer_ids: tuple = ()):
    """A freshly initialised head shaped for `target_cfg` (tests, and the trainer's start);
    draft_vocab_size: rows of EAGLE3's LM head, or of EAGLE's own one (0: EAGLE shares the
    target's); aux_layer_ids: EAGLE3's fused target layers (() = SGLang's default low, middle,
    high)."""
    if algorithm not in HEAD_ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {list(HEAD_ALGORITHMS)}")
    layer_cfg = target_cfg.with_overrides(
        num_layers=1, tie_word_embeddings=False,
        intermediate_size=intermediate_size or target_cfg.intermediate_size)
    spec = HeadSpec(algorithm=algorithm, layer_cfg=layer_cfg,
                    draft_vocab_size=(draft_vocab_size if algorithm in DRAFT_VOCAB_ALGORITHMS
                                      else 0),
                    aux_layer_ids=(tuple(aux_layer_ids) or default_aux_layer_ids(
                        target_cfg.num_layers)) if algorithm == "EAGLE3" else (),
                    has_head=algorithm == "EAGLE3" or (algorithm == "EAGLE"
                                                       and draft_vocab_size > 0))
    head = build_head(spec, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in head.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return head, spec
