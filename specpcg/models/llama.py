"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) built from our own layers.

Parameter names follow Hugging Face, so checkpoints load with a plain `load_state_dict`.
The body (`forward`) returns hidden states; the LM head runs separately (`compute_logits`), so a
captured graph of the body serves any batch and any logprob request.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import gemv
from kernels.topk import argmax_rows
from specpcg.attention.base import AttentionBackend
from specpcg.forward_context import current_forward_context, get_forward_context
from specpcg.graphs.breakable import eager_break
from specpcg.models.config import ModelConfig
from specpcg.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
              rotate=None) -> torch.Tensor:
    """Attention for the forward in flight; the batch comes from the forward context.
    rotate: (rotary, positions) to apply to q and k first, in place.

    A paged backend's K/V write is plain tensor work on static slots, so it runs here, inside a
    piecewise graph's segment, fused with the rotary (one kernel on CUDA where the two took
    three); the break is then the attention kernel alone, writing into the buffer the next
    segment reads (no allocation or copy at replay)."""
    ctx = get_forward_context()
    backend = ctx.attn_backend
    if rotate is not None and backend.paged:
        backend.rotate_and_save_kv(*rotate, q, k, v, layer_id, ctx.batch)
        return _attend(q, layer_id)
    v = v.contiguous()  # the paths below view or hand it on whole
    if rotate is not None:
        rotate[0](rotate[1], q, k)  # in place
    if not backend.paged:
        return _attention_unpaged(q, k, v, layer_id)
    backend.save_kv(k, v, layer_id, ctx.batch)
    return _attend(q, layer_id)


@eager_break(writes_out=True)
def _attend(q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    ctx = get_forward_context()
    return ctx.attn_backend.attend(q, layer_id, ctx.batch, out)


_BASE_ROTATE = AttentionBackend.rotate_and_save_kv


@eager_break
def _attention_unpaged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer_id: int) -> torch.Tensor:
    ctx = get_forward_context()
    return ctx.attn_backend.forward(q, k, v, layer_id, ctx.batch)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        # One GEMM for q, k and v (checkpoints' q/k/v_proj are concatenated at load).
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary  # shared, not a parameter owner

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def forward_normed_rope(self, positions: torch.Tensor, hidden: torch.Tensor, residual,
                            norm: RMSNorm) -> tuple | None:
        """(the layer over norm(hidden + residual), hidden + residual) with the norm, the qkv
        projection, the rotary and the K/V write in one launch where it fits
        (kernels/gemv.rope_fits: a decode step or a verify of a few rows), else None. Not
        outside a forward context, nor where a paged backend writes K/V its own way, nor where
        q and k are normed first, nor where `forward` is replaced (a training forward)."""
        fused = getattr(self.qkv_proj, "forward_normed_rope", None)
        if fused is None or hasattr(self, "q_norm") or "forward" in self.__dict__:
            return None
        ctx = current_forward_context()
        if ctx is None:
            return None
        backend = ctx.attn_backend
        if not backend.paged or type(backend).rotate_and_save_kv is not _BASE_ROTATE:
            return None
        pool = backend.kv_cache.pool
        rope = (positions, self.rotary.cos_sin, ctx.batch.out_cache_loc[:hidden.shape[0]],
                pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id], self.num_heads,
                self.num_kv_heads, self.head_dim)
        done = fused(hidden, residual, norm, rope)
        if done is None:
            return None
        qkv, residual = done
        return self.o_proj(_attend(qkv[:, :self.split_sizes[0]], self.layer_id)), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The layer past its qkv projection (whose output is `qkv`)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # v stays a view into the qkv output (rows strided): the fused rotary + KV write reads it
        # by its row stride; a copy here was one more kernel in each layer of every step.
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        out = attention(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, self.layer_id,
                        rotate=(self.rotary, positions))
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden: torch.Tensor, residual, entering: list | None = None):
        """Returns (mlp output, residual stream before it); the caller adds them (fused). Each
        norm runs in the launch of the matmul after it where that fits (`_normed`); the rotary
        and the K/V write run in the qkv projection's too where that fits. entering: a list
        that takes the residual stream entering the layer (hidden + residual), a tensor of its
        own as the input norm's launch writes it: an aux layer's hidden state without an add
        kernel of its own (three a step of an EAGLE3 target, each a break in the launch chain)."""
        roped = self.self_attn.forward_normed_rope(positions, hidden, residual,
                                                   self.input_layernorm)
        qkv = None if roped else _normed(self.input_layernorm, self.self_attn.qkv_proj, hidden,
                                         residual)
        if roped:
            hidden, residual = roped
        elif qkv is not None:
            qkv, residual = qkv
            hidden = self.self_attn.attend(positions, qkv)
        else:
            if residual is None:
                residual, hidden = hidden, self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm.forward_add(hidden, residual)
            hidden = self.self_attn(positions, hidden)
        if entering is not None:
            entering.append(residual)
        act = _normed(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual,
                      silu_mul=True)
        if act is None:
            hidden, residual = self.post_attention_layernorm.forward_add(hidden, residual)
            return self.mlp(hidden), residual
        act, residual = act
        return self.mlp.down_proj(act), residual


def run_layers(layers, positions, hidden, residual, aux_at, aux: list) -> tuple:
    """`layers` in turn from (hidden, residual); `aux` takes the residual stream entering each
    layer whose index among them is in `aux_at` (LlamaDecoderLayer's `entering`)."""
    for i, layer in enumerate(layers):
        hidden, residual = layer(positions, hidden, residual, aux if i in aux_at else None)
    return hidden, residual


def _normed(norm, linear, hidden, residual, silu_mul: bool = False) -> tuple | None:
    """(linear over norm(hidden + residual), hidden + residual) in one launch where the layer
    takes it (layers.Linear.forward_normed; a batch-invariant layer has none, and a training
    forward's `self_attn` is patched: both take the norm's kernel, then the layer), else None."""
    fused = getattr(linear, "forward_normed", None)
    return None if fused is None else fused(hidden, residual, norm, silu_mul)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple = ()):
        """Returns (final normed hidden [T, H], [residual stream entering each aux layer])."""
        aux = []
        hidden, residual = run_layers(self.model.layers, positions,
                                      self.model.embed_tokens(input_ids), None, aux_layers, aux)
        hidden, last = self.model.norm.forward_add(hidden, residual)
        if len(self.model.layers) in aux_layers:  # the last layer's output
            aux.append(last)
        return hidden, aux

    # The LM head's matmul (enable_deterministic_inference swaps in a batch-invariant one; one
    # row on CUDA takes the GEMV kernel).
    head_linear = staticmethod(gemv.linear)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_linear(hidden, self.head_weight).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token per row of `hidden` (a draft's greedy step or a greedy verify,
        inside their graphs), read from the head's own dtype: no fp32 copy of the logits."""
        return argmax_rows(self.head_linear(hidden, self.head_weight))

    def load_weights(self, state_dict: dict) -> None:
        """Takes Hugging Face parameter names; fuses q/k/v and gate/up into one matrix each."""
        missing, unexpected = self.load_state_dict(fuse_projections(state_dict), strict=False)
        missing = [m for m in missing if not m.endswith("rotary.cos_sin")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state_dict: dict) -> dict:
    """HF names -> ours: concatenates the parts of each fused projection along the output dim."""
    out = dict(state_dict)
    layer_prefixes = {k[:k.index(".self_attn.")] for k in state_dict if ".self_attn." in k}
    for prefix in layer_prefixes:
        for fused, parts in _FUSED.items():
            for suffix in ("weight", "bias"):
                names = [f"{prefix}.{p}.{suffix}" for p in parts]
                if all(n in out for n in names):
                    out[f"{prefix}.{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names], 0)
    return out
