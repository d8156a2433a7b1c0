"""EAGLE-family draft heads: one decoder layer that reads the target's hidden states.

Every head runs as a model of its own KV cache (one layer, layer id 0) through a ModelRunner:
`forward(input_ids, positions, aux_layers, input_hidden)` returns `(head_hidden, [next_hidden])`,
where `head_hidden` feeds the LM head (`compute_logits`, target-vocabulary logits) and
`next_hidden` is the hidden state the next draft step takes as `input_hidden`. Position p pairs
the hidden state that predicted token p + 1 with the embedding of token p + 1; its output
predicts token p + 2.

- EAGLE (EAGLE-1/2 layout, `LlamaForCausalLMEagle`): `fc([embedding; hidden])`, one decoder layer
  without its input norm, no final norm; the target's LM head, or its own over a smaller draft
  vocabulary mapped by `d2t` (the trainer's default: a 16,384-row head costs a third of the
  target's 49,152 rows per draft step and per training step).
- EAGLE3 (`LlamaForCausalLMEagle3`): `fc` fuses three target layers' states (3H -> H) once, on
  the way in; the mid layer attends over `[norm(embedding); norm(hidden)]` (2H wide), a final
  norm, its own LM head over a smaller draft vocabulary mapped to target ids by `d2t`.
- NEXTN (DeepSeek-style multi-token prediction): `eh_proj([enorm(embedding); hnorm(hidden)])`,
  a full decoder layer, `shared_head.norm` and the shared (target) head.

Heads without their own embedding (or LM head) share the target's: `attach_target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.topk import argmax_rows, topk_rows
from specpcg.models.config import ModelConfig
from specpcg.models.layers import BucketedLinear, RMSNorm, RotaryEmbedding
from specpcg.models.llama import LlamaAttention, LlamaDecoderLayer

HEAD_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True)
class HeadSpec:
    """What a head checkpoint declares, beyond the shape of its one decoder layer."""

    algorithm: str  # EAGLE | EAGLE3 | NEXTN
    layer_cfg: ModelConfig  # num_layers == 1; vocab_size is the target's
    draft_vocab_size: int = 0  # rows of its own LM head (EAGLE, EAGLE3; 0: the target's vocab)
    aux_layer_ids: tuple = ()  # EAGLE3: target layers whose outputs it fuses (SGLang's ids)
    fc_bias: bool = False  # EAGLE-1 checkpoints carry a bias on fc
    has_embed: bool = False  # the checkpoint ships embed_tokens
    has_head: bool = False  # the checkpoint ships its own LM head (EAGLE3 always)
    extra: dict = field(default_factory=dict)


def default_aux_layer_ids(num_target_layers: int) -> tuple:
    """SGLang's default EAGLE3 layers (low, middle, high), as output-of-layer ids; shallow
    targets (tests) take the first, middle and last layer."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4) if n >= 8 else (0, n // 2, n - 1)


class DraftHead(nn.Module):
    """Shared plumbing: embedding and LM head (own or the target's), logits, target hidden."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        cfg = spec.layer_cfg
        self.spec = spec
        self.config = cfg
        self.hidden_in_size = cfg.hidden_size  # what `input_hidden` holds (after projection)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        if spec.has_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self._target = []  # the target model, outside the parameter tree (never saved)
        # A head with its own LM head over a draft vocabulary: draft id d is target id
        # draft_to_target[d] (checkpoints store d2t[d] = draft_to_target[d] - d). None: its logits
        # are the target vocabulary's, in order.
        self.register_buffer("draft_to_target", None, persistent=False)
        self.d2t_is_identity = True

    def own_lm_head(self, vocab: int) -> None:
        self.lm_head = nn.Linear(self.config.hidden_size, vocab, bias=False)
        self.register_buffer("draft_to_target", torch.arange(vocab), persistent=False)

    def set_d2t(self, d2t: torch.Tensor) -> None:
        ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
        self.draft_to_target = ids.to(self.draft_to_target.device)
        self.d2t_is_identity = bool((d2t == 0).all())

    def attach_target(self, target) -> None:
        self._target = [target]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.spec.has_embed:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.spec.has_head else self._target[0].head_weight

    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as this head's `input_hidden` (identity but for EAGLE3)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits; a draft vocabulary's are placed at their target ids and
        every other id gets -inf."""
        draft = torch.nn.functional.linear(hidden, self.head_weight).float()
        if draft.shape[-1] == self.config.vocab_size and self.d2t_is_identity:
            return draft
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = draft
        return full

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax target token per row (a greedy draft step, inside the round's graph)."""
        # The argmax over the head's own logits (no fp32 copy, no [bs, target vocab] scatter),
        # mapped to target ids; bf16 and fp32 logits have the same argmax.
        best = argmax_rows(torch.nn.functional.linear(hidden, self.head_weight))
        return best if self.draft_to_target is None else self.draft_to_target[best]

    def top_children(self, hidden: torch.Tensor, k: int) -> tuple:
        """A tree step's K best target tokens per row and their log-probabilities ([T, K]
        each), from the head's own logits: the top-k maps draft ids to target ids itself."""
        logits = torch.nn.functional.linear(hidden, self.head_weight)
        return topk_rows(logits, k, log_softmax=True, index_map=self.draft_to_target)


class EagleHead(DraftHead):
    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        cfg = spec.layer_cfg
        self.fc = BucketedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=spec.fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0, self.rotary)])
        del self.layers[0].input_layernorm  # EAGLE's first layer has no input norm
        if spec.has_head:
            self.own_lm_head(spec.draft_vocab_size or cfg.vocab_size)

    def forward(self, input_ids, positions, aux_layers=(), input_hidden=None):
        x = self.fc(torch.cat([self.embed(input_ids), input_hidden.to(self.fc.weight.dtype)], -1))
        layer = self.layers[0]
        h = layer.self_attn(positions, x)
        h, residual = layer.post_attention_layernorm.forward_add(h, x)
        out = layer.mlp(h) + residual
        return out, [out]


class Eagle3Head(DraftHead):
    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        cfg = spec.layer_cfg
        hidden = cfg.hidden_size
        self.fc = BucketedLinear(len(spec.aux_layer_ids) * hidden, hidden, bias=False)
        self.midlayer = LlamaDecoderLayer(cfg, 0, self.rotary)
        # The mid layer's attention reads [embedding; hidden]: q/k/v take 2H inputs.
        attn: LlamaAttention = self.midlayer.self_attn
        attn.qkv_proj = BucketedLinear(2 * hidden, attn.qkv_proj.out_features,
                                  bias=cfg.attention_bias)
        self.midlayer.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.own_lm_head(spec.draft_vocab_size or cfg.vocab_size)

    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] == self.config.hidden_size:
            return hidden
        return self.fc(hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids, positions, aux_layers=(), input_hidden=None):
        layer = self.midlayer
        residual = input_hidden.to(self.norm.weight.dtype)
        # In the head's dtype: a head trained in fp32 reads a bf16 target's embeddings, and the
        # norms write their halves of one tensor of one dtype.
        embedded = self.embed(input_ids).to(residual.dtype)
        # [norm(embedding); norm(hidden)], each norm writing its half: no concatenation.
        x = embedded.new_empty(embedded.shape[0], 2 * embedded.shape[1])
        layer.input_layernorm(embedded, out=x[:, :embedded.shape[1]])
        layer.hidden_norm(residual, out=x[:, embedded.shape[1]:])
        h = layer.self_attn(positions, x)
        h, residual = layer.post_attention_layernorm.forward_add(h, residual)
        normed, prenorm = self.norm.forward_add(layer.mlp(h), residual)
        return normed, [prenorm]


class NextNHead(DraftHead):
    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        cfg = spec.layer_cfg
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = BucketedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(cfg, 0, self.rotary)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if spec.has_head:
            self.shared_head.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        if self.spec.has_head:
            return self.shared_head.head.weight
        return self._target[0].head_weight

    def forward(self, input_ids, positions, aux_layers=(), input_hidden=None):
        hidden = input_hidden.to(self.eh_proj.weight.dtype)
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden)], -1))
        h, residual = self.layer(positions, x, None)
        normed, _ = self.shared_head.norm.forward_add(h, residual)
        return normed, [normed]


HEAD_CLASSES = {"EAGLE": EagleHead, "EAGLE3": Eagle3Head, "NEXTN": NextNHead}


def build_head(spec: HeadSpec, device, dtype) -> DraftHead:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return HEAD_CLASSES[spec.algorithm](spec)
    finally:
        torch.set_default_dtype(old)
