"""Fine-tuning a STANDALONE draft: the target's first K layers plus its final norm and LM head
(`drafts.truncate`'s cut), every weight trained on the target's greedy labels, written as a
Hugging Face directory that `Engine(speculative_algorithm="STANDALONE", ...)` and transformers
load."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafts.train_data import Features, length_batches
from drafts.train_loop import LoopOptions, evaluate, fit, heldout_curve
from drafts.truncate import (CONFIG_NAME, WEIGHTS_NAME, config_from_hf_dir,
                             config_from_model_config, select_layers)
from specpcg.attention.dense import DenseAttnBackend, dense_batch, dense_forward
from specpcg.core import ForwardBatch


def truncated_model(target_path: str, num_layers: int, device):
    """(trainable fp32 draft model, its ModelConfig): the target's first `num_layers` layers."""
    from specpcg.models.build import build_model
    from specpcg.models.loader import load_checkpoint

    cfg, state = load_checkpoint(target_path)
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}] (the target's layer "
                         f"count), got {num_layers!r}")
    draft_cfg = cfg.with_overrides(num_layers=num_layers)
    model = build_model(draft_cfg, select_layers(state, num_layers), device, torch.float32)
    return model.train().requires_grad_(True), draft_cfg


@dataclass
class LMRows:
    """Whole sequences; row p predicts the target's greedy token after p (its label at p)."""

    batch: ForwardBatch
    labels: torch.Tensor  # [R]
    acc_mask: torch.Tensor  # [R] the predicted token lies in the answer


def lm_rows(feats: Features, seq_ids: list, device) -> LMRows:
    lens = [feats.seq_len(i) for i in seq_ids]
    at = torch.cat([torch.arange(feats.offsets[i], feats.offsets[i + 1]) for i in seq_ids])
    at = at.to(feats.labels.device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    prompt_lens = torch.tensor([feats.prompt_lens[i] for i in seq_ids]).repeat_interleave(
        torch.tensor(lens)).to(device)
    return LMRows(dense_batch(feats.token_ids[at].to(device), lens),
                  feats.labels[at].to(device), pos + 1 >= prompt_lens)


def _logits(model, backend, rows: LMRows, mask: torch.Tensor) -> torch.Tensor:
    hidden, _ = dense_forward(model, backend, rows.batch)
    return model.compute_logits(hidden[mask])


def standalone_loss(model, backend, rows: LMRows) -> torch.Tensor:
    hidden, _ = dense_forward(model, backend, rows.batch)
    return F.cross_entropy(model.compute_logits(hidden), rows.labels)


def standalone_accuracy(model, backend, rows: LMRows):
    pred = _logits(model, backend, rows, rows.acc_mask).argmax(-1)
    return (pred == rows.labels[rows.acc_mask]).sum()[None], rows.acc_mask.sum()[None]


def hf_state(model, cfg) -> dict:
    """The model's weights under Hugging Face names: fused q/k/v and gate/up split again."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
              "gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate_size] * 2)}
    out = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in splits if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        parts, sizes = splits[fused]
        for part, piece in zip(parts, tensor.split(sizes, 0)):
            out[name.replace(f".{fused}.", f".{part}.")] = piece
    return {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in out.items()}


def save_standalone(model, draft_cfg, target_path: str, out_dir: str) -> str:
    """config.json (the target's, cut to K layers), bf16 safetensors, and the target's
    tokenizer files when it has a tokenizer (a tokenizer-less target: ids only)."""
    from safetensors.torch import save_file

    from specpcg.tokenizer import load_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    k = draft_cfg.num_layers
    config = config_from_hf_dir(target_path, k, torch.bfloat16) if os.path.isdir(target_path) \
        else config_from_model_config(draft_cfg, k, torch.bfloat16)
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(hf_state(model, draft_cfg), os.path.join(out_dir, WEIGHTS_NAME),
              metadata={"format": "pt"})
    try:
        tokenizer = load_tokenizer(target_path)
    except ValueError:
        return out_dir  # no tokenizer files to ship (tests' tiny targets)
    tokenizer.hf_tokenizer.save_pretrained(out_dir)
    return out_dir


def train_standalone(target_path: str, feats: Features, split: dict, opts: LoopOptions,
                     num_layers: int, device, out_dir: str) -> dict:
    model, draft_cfg = truncated_model(target_path, num_layers, device)
    backend = DenseAttnBackend(draft_cfg.num_heads, draft_cfg.num_kv_heads, draft_cfg.head_dim,
                               draft_cfg.head_dim ** -0.5)
    lens = [feats.seq_len(i) for i in range(feats.num_seqs)]
    train_batches = length_batches(lens, split["train"], opts.token_budget)
    eval_batches = length_batches(lens, split["heldout"], opts.token_budget)
    rows = lambda seq_ids: lm_rows(feats, seq_ids, device)  # noqa: E731
    accuracy = lambda b: standalone_accuracy(model, backend, rows(b))  # noqa: E731
    initial = evaluate(model, eval_batches, accuracy)
    record = fit(model, list(model.parameters()), train_batches,
                 lambda b: standalone_loss(model, backend, rows(b)), opts,
                 probe=lambda: evaluate(model, eval_batches, accuracy))
    record.update(initial_heldout_top1=initial, num_layers=num_layers,
                  heldout_top1_curve=heldout_curve(record),
                  heldout_top1=evaluate(model, eval_batches, accuracy))
    save_standalone(model, draft_cfg, target_path, out_dir)
    return record
